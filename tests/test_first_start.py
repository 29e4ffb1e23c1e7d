"""The first start's second process (fucina_course/startup.py): what it compiles is
found in the disk caches by a real forward pass, never compiled again, and it reports
each of the main process's kernels it takes on once they are on disk.

A numba cache entry is reused only for exactly the argument types it was compiled
for, so a helper that ran a subtly different code path (another array layout, a
writable instead of a read-only weight) would compile kernels that nobody loads:
the first start would be as slow as without it, and nothing else would notice.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from fucina_course import startup
from model_cases import tiny_model, tiny_moe_model

# The kernels of the prefill path outside quant/: the helper's share of the work
# (with the formats' LLVM modules).
PREFILL_KERNELS = {"fucina_course.ops._rms_norm_rows", "fucina_course.ops._rope",
                   "fucina_course.ops._swiglu", "fucina_course.kv_cache._narrow",
                   "fucina_course.attention._by_kv_head_f16",
                   "fucina_course.attention._causal_softmax_f16"}

# Prints {kernel: [cache hits, cache misses]} of every numba kernel of the package
# that ran in this process (a miss is a compilation: the cache did not have it).
_STATS = """
import json, sys
from numba.core.dispatcher import Dispatcher
stats = {}
for name, mod in list(sys.modules.items()):
    if not name.startswith("fucina_course"):
        continue
    for attr, obj in vars(mod).items():
        if isinstance(obj, Dispatcher) and obj.py_func.__module__ == name:
            s = obj.stats
            hits, misses = sum(s.cache_hits.values()), sum(s.cache_misses.values())
            if hits or misses:
                stats[f"{name}.{attr}"] = [hits, misses]
print(json.dumps(stats))
"""

_HELPER = """
import sys
from fucina_course.startup import compile_prefill
compile_prefill(sys.argv[1])
""" + _STATS

# The main process's side of startup.first_start: a decode step, then a prefill.
_FORWARD = """
import sys
from fucina_course.model import Model
model = Model.load(sys.argv[1], tokenizer=False)
cache = model.new_cache(4)
model.forward_step([0], 0, cache)
model.forward_step([0, 0], 1, cache)
""" + _STATS


def _stats(code: str, model, env) -> dict:
    out = subprocess.run([sys.executable, "-c", code, str(model)], env=env, text=True,
                         capture_output=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.splitlines()[-1])


@pytest.mark.parametrize("which", ["qwen3-q4_k", "qwen3moe-q8_0", "coder"])
def test_what_the_helper_compiles_is_a_cache_hit(which, tmp_path, coder_path):
    model = {"qwen3-q4_k": lambda: tiny_model("Q4_K", tmp_path),
             "qwen3moe-q8_0": lambda: tiny_moe_model("Q8_0", tmp_path),
             "coder": lambda: coder_path}[which]()
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba")}
    helper = _stats(_HELPER, model, env)
    compiled = {k for k, (_, misses) in helper.items() if misses}
    assert PREFILL_KERNELS <= compiled
    # zero products: no numba kernel of quant/ (the main process's share) was compiled
    assert not {k for k in compiled if k.startswith("fucina_course.quant.")}

    forward = _stats(_FORWARD, model, env)
    again = {k for k in compiled if forward.get(k, [0, 0])[1]}
    assert not again, f"compiled by the helper and again by the forward pass: {again}"
    loaded = {k for k in compiled if forward.get(k, [0, 0])[0]}
    assert PREFILL_KERNELS <= loaded


def test_the_helper_reports_its_share_once_it_is_on_disk(tmp_path, coder_path):
    # the main process waits for this report, then loads instead of compiling: it
    # must come only once the Coder's four formats' modules are in the disk cache
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba")}
    code = """if True:
        import sys
        from fucina_course import startup
        from fucina_course.gguf_file import GGUFFile
        from fucina_course.quant import _int, _jit, isa
        types = {t.ggml_type for t in GGUFFile(sys.argv[1]).tensors.values()}
        ints = [k for _, k in startup._kernels(types, None)
                if isinstance(k, _int.IntKernels)]
        before = [_jit.is_cached(k.name, isa.level) for k in ints]
        helper = startup.start(sys.argv[1])
        llvm = helper.reached(startup.LLVM_DONE)
        objects = [_jit.is_cached(k.name, isa.level) for k in ints]
        startup.join(helper)
        print(len(ints), any(before), llvm, all(objects), helper.returncode)
    """
    if startup.cores() < 2:
        pytest.skip("one core: no helper")
    out = subprocess.run([sys.executable, "-c", code, str(coder_path)], env=env,
                         text=True, capture_output=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["4", "False", "True", "True", "0"]


def test_a_helper_that_fails_costs_nothing(tmp_path):
    helper = startup.start(tmp_path / "missing.gguf")
    if helper is None:                                   # one core: no helper at all
        assert startup.cores() < 2
        return
    startup.join(helper)
    assert helper.returncode != 0


def test_stop_kills_a_helper_that_still_runs():
    helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    startup.join(helper, timeout=0.1)
    assert helper.returncode is not None and helper.returncode != 0


def _helpers_of(model) -> list[int]:
    """pids of running helper processes for `model` (Linux /proc)."""
    pids = []
    for d in os.listdir("/proc"):
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if b"fucina_course.startup" in argv and str(model).encode() in argv:
            pids.append(int(d))
    return pids


@pytest.mark.skipif(not os.path.isdir("/proc") or startup.cores() < 2,
                    reason="needs Linux /proc and two cores")
def test_a_command_that_fails_leaves_no_helper_behind(tmp_path):
    # cold cache: the helper starts as the model loads; the command then fails on
    # its own argument check, and the helper must not outlive it
    model = tiny_model("Q8_0", tmp_path)
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba")}
    out = subprocess.run([sys.executable, "-m", "fucina_course", "generate", str(model),
                          "--ids", "1,2", "--gen", "0"], env=env, text=True,
                         capture_output=True, timeout=120)
    assert out.returncode == 1 and "--gen must be at least 1" in out.stderr
    assert _helpers_of(model) == []


def test_a_cold_cli_run_starts_the_helper_early(tmp_path):
    # the same run with a valid argument: the helper is started before the model
    # loads and its prefill kernels are found by the main process
    model = tiny_model("Q8_0", tmp_path)
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba")}
    code = """if True:
        import sys, runpy
        from fucina_course import startup
        started = []
        real = startup.start
        startup.start = lambda path: started.append(path) or real(path)
        sys.argv = ["fucina", "generate", sys.argv[1], "--ids", "1,2", "--gen", "2"]
        try:
            runpy.run_module("fucina_course", run_name="__main__")
        except SystemExit as e:
            assert not e.code, e.code
        from fucina_course import attention
        s = attention._causal_softmax_f16.stats
        print(len(started), sum(s.cache_hits.values()), sum(s.cache_misses.values()))
    """
    out = subprocess.run([sys.executable, "-c", code, str(model)], env=env, text=True,
                         capture_output=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    started, hits, misses = map(int, out.stdout.split()[-3:])
    assert started == (1 if startup.cores() >= 2 else 0)
    if started:
        assert hits >= 1 and misses == 0
