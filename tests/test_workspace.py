"""The forward pass over buffers made once (workspace.py) gives the numbers it gives
over fresh arrays: the same logits and the same cache contents, bit for bit.

The reference is the very same forward pass with no workspace (`Model.reuse_buffers`
off: every op allocates its output, `workspace.NO_WORKSPACE`): what differs is only
where intermediates live, so a difference is a buffer written while still needed, a
stale row, or two steps sharing buffers.  Each case decodes a few tokens after a prompt both ways, each into its own
cache.  (When the buffers came in, 2026-12-02, a dump of 252 logit arrays -- 7 models,
every level, prefill, decode, batch, f16 and q8_0 caches -- was also compared with the
commit before, bit for bit.)
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from fucina_course import NonFiniteValues
from fucina_course.model import Model
from fucina_course.quant import isa
from fucina_course.synth import TINY_QWEN3, with_format, write_synthetic
from model_cases import FORMATS, MOE_FORMATS, tiny_model, tiny_moe_model

_MODELS: dict = {}


@pytest.fixture(scope="module")
def synth_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("synth_decode")


def load(path) -> Model:
    if str(path) not in _MODELS:
        _MODELS[str(path)] = Model.load(path)
    return _MODELS[str(path)]


class no_workspace:
    """`with no_workspace(model):` every op allocates its output (the reference)."""

    def __init__(self, model: Model):
        self.model = model

    def __enter__(self):
        self.model.reuse_buffers = False

    def __exit__(self, *exc):
        self.model.reuse_buffers = True


def assert_same_decode(model: Model, prompt, tokens, cache_type="f16", batch=False):
    """Prefill `prompt` into two caches, then decode `tokens` with buffers in one and
    without in the other: every step's logits and every cached row equal."""
    ours, ref = (model.new_cache(len(prompt) + len(tokens), cache_type) for _ in "ab")
    a = model.forward_step(prompt, 0, ours)
    with no_workspace(model):
        b = model.forward_step(prompt, 0, ref)
    assert np.array_equal(a, b), "prefill"
    for t in tokens:
        a = model.forward_step([t], ours.len, ours)
        with no_workspace(model):
            b = model.forward_step([t], ref.len, ref)
        assert np.array_equal(a, b), f"token {t} at {ref.len - 1}: max |diff| " \
                                     f"{np.abs(a - b).max():.3g}"
    assert ours.len == ref.len
    stores = ["k", "v"] + (["k_scale", "v_scale"] if cache_type == "q8_0" else [])
    for name in stores:
        for layer, (x, y) in enumerate(zip(getattr(ours, name), getattr(ref, name))):
            assert np.array_equal(x[:ours.len], y[:ref.len]), (name, layer)


def _ids(n: int, seed: int, vocab: int = 4093) -> list[int]:
    return np.random.default_rng(seed).integers(0, vocab, size=n).tolist()


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_format(fmt, synth_dir):
    assert_same_decode(load(tiny_model(fmt, synth_dir)), _ids(7, 1), _ids(5, 2))


@pytest.mark.parametrize("fmt", MOE_FORMATS)
def test_mixture_of_experts(fmt, synth_dir):
    assert_same_decode(load(tiny_moe_model(fmt, synth_dir)), _ids(7, 3), _ids(5, 4))


@pytest.mark.parametrize("level", isa.LEVELS)
def test_every_level(level, synth_dir, monkeypatch):
    """Each matrix binds its kernel per level (weights._Product): a level change
    rebinds."""
    if level not in isa.USABLE:
        pytest.skip(f"this CPU cannot run {level}")
    model = load(tiny_model("Q4_K", synth_dir))
    monkeypatch.setattr(isa, "level", level)
    assert_same_decode(model, _ids(5, 5), _ids(4, 6))


def test_untied_output_and_q8_0_cache(synth_dir):
    spec = with_format(TINY_QWEN3, "Q5_0", tied_embeddings=False, output_type="Q6_K",
                       name="tiny-untied")
    path = synth_dir / "tiny-untied.gguf"
    write_synthetic(spec, path)
    model = load(path)
    assert model.output is not model.embedding
    assert_same_decode(model, _ids(6, 7), _ids(4, 8))
    assert_same_decode(model, _ids(6, 7), _ids(4, 8), cache_type="q8_0")


def test_rope_table_blocks(synth_dir):
    """Positions on both sides of a RoPE table block boundary (ops.RopeTable.BLOCK)."""
    model = load(tiny_model("Q8_0", synth_dir))
    assert_same_decode(model, _ids(250, 9), _ids(12, 10))


@pytest.mark.parametrize("name", ["coder", "smollm"])
def test_real_models(name, coder_path, smollm_path):
    """Qwen2.5-Coder (qwen2: q/k/v biases, q+k and v in two formats, so two kernel
    calls) and SmolLM2 (llama: "normal" RoPE pairs)."""
    model = load(coder_path if name == "coder" else smollm_path)
    prompt = model.tokenizer.encode("The capital of France is")
    assert_same_decode(model, prompt, _ids(6, 11, 1000))


def test_batches_and_short_prefills_share_the_buffers(synth_dir):
    """A batch step, a 3-token step and one-token steps in turn reuse one workspace
    (grown to the longest step): each gives what it gives without buffers."""
    model = load(tiny_model("Q4_0", synth_dir))
    caches = [model.new_cache(16) for _ in range(6)]
    plain = [model.new_cache(16) for _ in range(6)]
    steps = [([1, 2, 3], [0]), ([4], [1]), ([5, 6], [0, 1]), ([7, 8, 9, 10], [2, 3, 4, 5]),
             ([11], [0])]
    for ids, streams in steps:
        for run, cs in ((None, caches), (no_workspace(model), plain)):
            with run or _nothing():
                if len(streams) == 1:
                    c = cs[streams[0]]
                    out = model.forward_step_all_logits(ids, c.len, c)
                else:
                    out = model.forward_step_batch(ids, [cs[i] for i in streams])
            if run is None:
                ours = out
        assert np.array_equal(ours, out), (ids, streams)


class _nothing:
    def __enter__(self):
        pass

    def __exit__(self, *exc):
        pass


def test_threads_have_their_own_buffers(synth_dir):
    """Two threads decoding their own streams at once get the sequential numbers."""
    model = load(tiny_model("Q8_0", synth_dir))
    prompts = [_ids(9, 20), _ids(4, 21)]

    def decode(prompt):
        cache = model.new_cache(40)
        out = [model.forward_step(prompt, 0, cache)]
        for _ in range(24):
            out.append(model.forward_step([int(np.argmax(out[-1]))], cache.len, cache))
        return np.stack(out)

    expected = [decode(p) for p in prompts]
    got = [None, None]
    start = threading.Barrier(2)

    def worker(i):
        start.wait()
        got[i] = decode(prompts[i])

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(np.array_equal(g, e) for g, e in zip(got, expected))


def test_profile_and_check_numerics_give_the_same_numbers(synth_dir):
    model = load(tiny_model("Q8_0", synth_dir))
    prompt, tok = _ids(5, 12), 17
    cache = model.new_cache(8)
    model.forward_step(prompt, 0, cache)
    expected = model.forward_step([tok], 5, cache)
    for name, on, off in (("profile", {}, None), ("check_numerics", True, False)):
        setattr(model, name, on)
        try:
            cache.truncate(5)
            assert np.array_equal(model.forward_step([tok], 5, cache), expected), name
            if name == "profile":
                assert set(model.profile) == {"embedding", "attention", "ffn", "lm_head"}
        finally:
            setattr(model, name, off)


def test_non_finite_activations_name_the_stage(synth_dir):
    """An infinite norm weight: the error names the stage, with and without the
    profile's timers."""
    model = Model.load(tiny_model("Q8_0", synth_dir))
    bad = np.array(model.layers[1].ffn_norm)
    bad[3] = np.inf
    model.layers[1].ffn_norm = bad
    errors = []
    for profile in (None, {}):
        model.profile = profile
        with pytest.raises(NonFiniteValues, match="non-finite in the ffn stage") as e:
            model.forward_step([3], 0, model.new_cache(4))
        errors.append(str(e.value))
    model.profile = None
    assert errors[0] == errors[1]


def test_the_tape_is_recorded_again_when_the_model_changes(synth_dir):
    """A tape holds the arrays and the config it saw: a new config (chapter 04 swaps
    the RoPE layout), a layer's weight assigned anew, or `forget_tape` after changing
    weights in place record the step again."""
    model = Model.load(tiny_model("Q8_0", synth_dir))
    prompt, tok = _ids(6, 30), 11

    def step():
        cache = model.new_cache(12)
        model.forward_step(prompt, 0, cache)
        model.forward_step([tok], cache.len, cache)           # recorded (or replayed)
        return model.forward_step([tok], cache.len, cache)    # replayed

    def reference():
        with no_workspace(model):
            cache = model.new_cache(12)
            model.forward_step(prompt, 0, cache)
            model.forward_step([tok], cache.len, cache)
            return model.forward_step([tok], cache.len, cache)

    from dataclasses import replace
    from fucina_course.families import FAMILIES

    step()
    tape = model._local.tape
    model.config = replace(model.config, family=FAMILIES["llama"])   # "normal" RoPE
    assert np.array_equal(step(), reference()) and model._local.tape is not tape
    layer = model.layers[1]
    layer.ffn_norm = np.array(layer.ffn_norm) * 2                     # a new array
    assert np.array_equal(step(), reference())
    layer.ffn_norm *= 0.5                                             # in place
    model.forget_tape()
    assert np.array_equal(step(), reference())


def test_a_block_that_makes_temporaries_is_called_again():
    """An op that had to copy its input marks the block: replaying the copy's old
    contents would be wrong, so the tape calls that block again."""
    from types import SimpleNamespace

    from fucina_course import tape

    buffer = np.zeros((1, 4), np.float32)
    ws = SimpleNamespace(view=lambda n: SimpleNamespace(out=buffer))

    def block(x):
        tape.fresh()                           # as ops do when they copy
        tape.call(np.add, x, 1.0, buffer)
        return buffer

    t = tape.Tape((), (), ws, None, np.zeros((1, 4), np.float32), [None], None, None)
    t.record("ffn", block, np.ones((1, 4), np.float32))
    assert t.blocks[0].calls is None           # no calls kept: the block is called
    t.replay(SimpleNamespace(stage=""))
    assert np.array_equal(t.x, np.full((1, 4), 2.0))


def test_an_interrupted_first_decode_step_leaves_no_half_tape(smollm_path, monkeypatch):
    """Ctrl-C in the middle of the first one-token step (the one that records the
    tape): the next generation on the same model object equals a fresh model's.
    Before the tape was published only once complete, the interrupted step left a
    tape of its first layers, and SmolLM2 went on with [7042, 28, 216, 28, ...]
    instead of [7042, 30, 198, 198, ...]: silently wrong text, forever."""
    import fucina_course.model as model_mod

    fresh = Model.load(smollm_path)
    prompt = fresh.tokenizer.encode("The capital of France is")
    want = fresh.generate(prompt, 10)

    model = Model.load(smollm_path)
    cache = model.new_cache(32)
    model.forward_step(prompt, 0, cache)
    calls, norm = [0], model_mod.rms_norm

    def interrupted_norm(*args, **kwargs):
        calls[0] += 1
        if calls[0] == len(model.layers) + 1:   # two norms a layer: half-way through
            raise KeyboardInterrupt
        return norm(*args, **kwargs)

    monkeypatch.setattr(model_mod, "rms_norm", interrupted_norm)
    with pytest.raises(KeyboardInterrupt):
        model.forward_step([want[0]], cache.len, cache)
    monkeypatch.setattr(model_mod, "rms_norm", norm)
    assert calls[0] > 4, "the step was not interrupted inside the layers"
    assert cache.len == len(prompt), "the interrupted step advanced the cache"
    assert getattr(model._local, "tape", None) is None, "a half tape was published"
    assert model.generate(prompt, 10) == want


def test_the_tape_sees_replaced_layers_ffn_parts_and_blocks(synth_dir, monkeypatch):
    """What a recorded step depends on beyond `Layer`'s own attributes: the list of
    layers (the last ones dropped), an FFN's own attribute (its down projection
    swapped for another layer's), and the module's block functions.  After each
    change the next decode step equals the blocks run without a tape."""
    import fucina_course.model as model_mod

    model = Model.load(tiny_model("Q8_0", synth_dir))
    prompt, tok = _ids(6, 40), 17

    def decode(reference: bool):
        cache = model.new_cache(12)
        model.reuse_buffers = not reference      # no workspace: no tape at all
        try:
            model.forward_step(prompt, 0, cache)
            model.forward_step([tok], cache.len, cache)
            return model.forward_step([tok], cache.len, cache)
        finally:
            model.reuse_buffers = True

    before = decode(False)
    assert np.array_equal(before, decode(True))
    last = model.layers[-1]
    model.layers = model.layers[:-1]                                  # a shorter model
    dropped = decode(False)
    assert np.array_equal(dropped, decode(True))
    assert not np.array_equal(dropped, before)
    model.layers[0].ffn.down = last.ffn.down                          # inside the FFN
    swapped = decode(False)
    assert np.array_equal(swapped, decode(True))
    assert not np.array_equal(swapped, dropped)
    ffn_block = model_mod.ffn_block
    monkeypatch.setattr(model_mod, "ffn_block",
                        lambda *a: ffn_block(*a) * np.float32(0.5))   # a new block
    halved = decode(False)
    assert np.array_equal(halved, decode(True))
    assert not np.array_equal(halved, swapped)


def test_the_debug_check_catches_a_stale_tape(synth_dir):
    """`check_tape_every = 1`: each replayed step also runs the blocks.  A tape that
    lost its last block (what an interrupted recording used to leave) is caught at
    the first replay, dropped, and the step after is right again."""
    from fucina_course import TapeMismatch

    model = Model.load(tiny_model("Q8_0", synth_dir))
    model.check_tape_every = 1
    prompt, tok = _ids(6, 41), 23
    cache = model.new_cache(12)
    model.forward_step(prompt, 0, cache)
    model.forward_step([tok], cache.len, cache)                       # recorded
    assert model._replays == 0
    model.forward_step([tok], cache.len, cache)                       # replayed, checked
    assert model._replays == 1
    del model._local.tape.blocks[-1]                                  # made stale
    at = cache.len
    with pytest.raises(TapeMismatch, match="differs from the blocks"):
        model.forward_step([tok], cache.len, cache)
    assert cache.len == at and getattr(model._local, "tape", None) is None
    ours = model.forward_step([tok], cache.len, cache)                # recorded again
    model.reuse_buffers = False
    ref_cache = model.new_cache(12)
    model.forward_step(prompt, 0, ref_cache)
    for _ in range(cache.len - len(prompt) - 1):
        model.forward_step([tok], ref_cache.len, ref_cache)
    ref = model.forward_step([tok], ref_cache.len, ref_cache)
    model.reuse_buffers = True
    assert np.array_equal(ours, ref)


def test_a_failed_step_leaves_every_cache_as_it_was(synth_dir):
    """All or nothing: a step whose logits come out non-finite (the last check of a
    step) raises, and neither a prefill, a decode step nor a batch of streams has
    advanced a cache; after the cause is gone the same calls go on from there."""
    model = Model.load(tiny_model("Q8_0", synth_dir))
    good = model.output_norm
    a, b = model.new_cache(16), model.new_cache(16)
    model.forward_step(_ids(5, 42), 0, a)
    model.forward_step(_ids(3, 43), 0, b)
    model.output_norm = np.full_like(good, np.inf)
    for call in (lambda: model.forward_step([5], a.len, a),
                 lambda: model.forward_step(_ids(4, 44), a.len, a),
                 lambda: model.forward_step_batch([5, 6], [a, b])):
        with pytest.raises(NonFiniteValues):
            call()
        assert (a.len, b.len) == (5, 3)
    model.output_norm = good
    assert np.isfinite(model.forward_step_batch([5, 6], [a, b])).all()
    assert (a.len, b.len) == (6, 4)


@pytest.mark.parametrize("value", ["x", "-1", "1.5", "9" * 20_000, "1 2"])
def test_a_malformed_tape_check_setting_is_one_error(synth_dir, monkeypatch, value):
    """FUCINA_CHECK_TAPE takes a non-negative integer; anything else (a word, a
    negative, 20,000 digits) is one FucinaError naming the variable, at load."""
    from fucina_course import FucinaError

    monkeypatch.setenv("FUCINA_CHECK_TAPE", value)
    with pytest.raises(FucinaError, match="FUCINA_CHECK_TAPE must be"):
        Model.load(tiny_model("Q8_0", synth_dir))
    monkeypatch.setenv("FUCINA_CHECK_TAPE", " 3 ")
    assert Model.load(tiny_model("Q8_0", synth_dir)).check_tape_every == 3
