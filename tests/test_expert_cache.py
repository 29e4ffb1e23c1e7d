"""Experts streamed from disk (expert_cache.py): the cache's rules on a file of known
bytes, and the model's logits and tokens, streamed, against the fully mapped run on
the synthetic Qwen3-MoE (two block formats)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from fucina_course.errors import FucinaError
from fucina_course.expert_cache import ExpertCache, attach, parse_size
from fucina_course.model import Model
from fucina_course.synth import TINY_QWEN3_MOE, cached_synthetic, with_format

SLOT = 3 * 64                       # three "matrices" of 64 bytes per expert


@pytest.fixture
def blob(tmp_path):
    """A file whose byte i is i % 251, and ranges for 2 layers x 6 experts."""
    path = tmp_path / "experts.bin"
    path.write_bytes(bytes(i % 251 for i in range(2 * 6 * SLOT)))
    ranges = {(layer, e): [((layer * 6 + e) * SLOT + m * 64, 64) for m in range(3)]
              for layer in range(2) for e in range(6)}
    return path, ranges


def expected(key) -> np.ndarray:
    start = (key[0] * 6 + key[1]) * SLOT
    return np.arange(start, start + SLOT) % 251


def test_slots_hold_the_files_bytes_and_the_least_recent_goes(blob):
    path, ranges = blob
    cache = ExpertCache(path, ranges, 3 * SLOT, pin_fraction=0, repin_every=0)
    for e in (0, 1, 2):
        cache.acquire(0, [e])
        cache.release()
    cache.acquire(0, [0])                       # 0 is now the most recent
    cache.release()
    cache.acquire(0, [3])                       # evicts 1, the least recent
    cache.release()
    assert set(cache.slot_of) == {(0, 0), (0, 2), (0, 3)}
    for key, slot in cache.slot_of.items():
        assert np.array_equal(cache.buffers[slot], expected(key))
    assert (cache.stats.hits, cache.stats.misses) == (1, 4)
    assert cache.stats.bytes_read == 4 * SLOT
    cache.close()


def test_the_most_used_are_pinned_and_survive(blob):
    path, ranges = blob
    cache = ExpertCache(path, ranges, 3 * SLOT, pin_fraction=1 / 3, repin_every=4)
    for _ in range(4):                          # (0, 5) used most: pinned at the 4th
        cache.acquire(0, [5])
        cache.release()
    assert cache.pinned == {(0, 5)}
    for e in range(5):                          # a sweep of others never evicts it
        cache.acquire(1, [e])
        cache.release()
    assert (0, 5) in cache.slot_of
    assert np.array_equal(cache.buffers[cache.slot_of[(0, 5)]], expected((0, 5)))
    cache.close()


def test_busy_slots_are_never_refilled(blob):
    path, ranges = blob
    cache = ExpertCache(path, ranges, 2 * SLOT, pin_fraction=0)
    slots = cache.acquire(0, [0, 1])            # both slots busy for this step
    cache.prefetch(1, [2, 3])                   # nothing to spare: no read starts
    assert cache.stats.prefetched == 0 and not cache.pending
    with pytest.raises(FucinaError, match="all in use"):
        cache.acquire(0, [2])
    for key, slot in zip([(0, 0), (0, 1)], slots):
        assert np.array_equal(cache.buffers[slot], expected(key))
    cache.release()
    cache.close()


def test_a_prefetched_expert_counts_as_read_ahead(blob):
    path, ranges = blob
    cache = ExpertCache(path, ranges, 4 * SLOT, pin_fraction=0)
    cache.acquire(0, [0], ahead=lambda: cache.prefetch(1, [4, 5]))
    cache.release()
    cache.acquire(1, [4])
    cache.release()
    st = cache.stats
    assert (st.prefetched, st.prefetch_hits, st.hits, st.misses) == (2, 1, 1, 1)
    assert np.array_equal(cache.buffers[cache.slot_of[(1, 4)]], expected((1, 4)))
    cache.close()


def test_a_read_error_is_one_line_and_the_cache_goes_on(blob):
    path, ranges = blob
    ranges[(1, 5)] = [(os.path.getsize(path) - 10, 64)] * 3     # past the end
    cache = ExpertCache(path, ranges, 3 * SLOT, pin_fraction=0)
    with pytest.raises(FucinaError) as info:
        cache.acquire(1, [5])
    assert "expert 5 of layer 1" in str(info.value) and "\n" not in str(info.value)
    cache.release()
    assert (1, 5) not in cache.slot_of and not cache.pending
    cache.acquire(0, [1])                       # the slot it took is free again
    cache.release()
    cache.close()


@pytest.mark.parametrize("text, size", [("2G", 2 << 30), ("512M", 512 << 20),
                                        ("1.5GiB", 3 << 29), ("4096", 4096),
                                        ("64kb", 64 << 10)])
def test_sizes(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "abc", "-1G", "0", "nanM", "1X", "9" * 20_000,
                                  "G" * 20_000])
def test_bad_sizes_are_refused(text):
    with pytest.raises(FucinaError):
        parse_size(text)


@pytest.mark.parametrize("fmt", ["Q8_0", "Q4_K"])
@pytest.mark.parametrize("slots", [3, 16])       # thrashing, and every expert fits
def test_streamed_logits_and_tokens_equal_the_mapped_run(fmt, slots):
    path = cached_synthetic(with_format(TINY_QWEN3_MOE, fmt))
    mapped, streamed = Model.load(path), Model.load(path)
    cache = attach(streamed, slots * mapped.layers[0].ffn.expert_nbytes)
    ids = mapped.tokenizer.encode("Once upon a time there was a")
    tokens = mapped.generate(ids, 20, stop_ids=set())
    assert streamed.generate(ids, 20, stop_ids=set()) == tokens
    longer = ids + tokens[:12]                               # a prefill of 19 rows
    assert np.array_equal(mapped.forward_last_logits(longer),
                          streamed.forward_last_logits(longer))
    assert cache.stats.bytes_read > 0 and cache.stats.misses > 0
    if slots == 16:                             # 2 layers x 8 experts: all resident
        assert cache.stats.hits > cache.stats.misses
    cache.close()


def test_a_cache_too_small_for_one_token_is_refused():
    model = Model.load(cached_synthetic(TINY_QWEN3_MOE))
    with pytest.raises(FucinaError, match="a token needs 2 at once"):
        attach(model, 2 * model.layers[0].ffn.expert_nbytes)


# --- the memory a process may use, and the budget chosen from it -----------------------

def test_the_budget_is_what_the_dense_weights_and_the_runtime_leave():
    from fucina_course.expert_cache import RUNTIME_BYTES, auto_budget, memory_allowed

    model = Model.load(cached_synthetic(TINY_QWEN3_MOE))
    size = model.gguf.size
    ffn = model.layers[0].ffn
    experts = sum(layer.ffn.expert_nbytes * len(layer.ffn.experts)
                  for layer in model.layers)
    assert auto_budget(model, allowed=size + RUNTIME_BYTES) is None      # it fits
    half = size + RUNTIME_BYTES - experts // 2
    assert auto_budget(model, allowed=half) == experts - experts // 2
    with pytest.raises(FucinaError, match="leave .* MiB for the experts"):
        auto_budget(model, allowed=size - experts + RUNTIME_BYTES + ffn.expert_nbytes)
    assert 0 < memory_allowed() <= os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _cgroups_writable() -> bool:
    probe = "/sys/fs/cgroup/memory/fucina-probe-test"
    try:
        os.mkdir(probe)
        os.rmdir(probe)
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _cgroups_writable(), reason="needs a writable cgroup v1 memory "
                    "hierarchy (root)")
def test_inside_a_memory_limit_the_experts_stream_by_themselves(tmp_path):
    """scripts/in_memory_limit.py puts the command in a cgroup that counts the page
    cache; in one smaller than the file plus the runtime, `fucina generate` picks an
    expert cache by itself and writes the same ids; a command that needs more is
    killed, and the script says so."""
    import subprocess
    import sys

    from fucina_course.expert_cache import RUNTIME_BYTES

    path = cached_synthetic(TINY_QWEN3_MOE)
    model = Model.load(path)
    experts = sum(layer.ffn.expert_nbytes * len(layer.ffn.experts)
                  for layer in model.layers)
    limit = model.gguf.size + RUNTIME_BYTES - experts // 2
    from pathlib import Path

    runner = [sys.executable, str(Path(__file__).resolve().parent.parent / "scripts"
                                  / "in_memory_limit.py")]
    gen = [sys.executable, "-m", "fucina_course", "generate", str(path), "--prompt",
           "Once upon a time", "--gen", "12", "--ignore-eos"]
    free = subprocess.run(gen + ["--ids-out", tmp_path / "free"], capture_output=True,
                          text=True, timeout=300)
    assert free.returncode == 0, free.stderr
    limited = subprocess.run(runner + [str(limit), "--"] + gen + [
        "--ids-out", tmp_path / "limited"], capture_output=True, text=True, timeout=300)
    assert limited.returncode == 0, limited.stderr
    assert "its experts are read from disk" in limited.stderr
    assert "OOM kills 0" in limited.stderr
    assert (tmp_path / "limited").read_text() == (tmp_path / "free").read_text()
    hog = subprocess.run(runner + ["100M", "--", sys.executable, "-c",
                                   "import numpy; numpy.ones(300 << 20, 'u1').sum()"],
                         capture_output=True, text=True, timeout=120)
    assert hog.returncode == 137 and "OOM kills 1" in hog.stderr
