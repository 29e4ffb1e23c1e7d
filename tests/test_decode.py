"""decode.py's one-token step against model.py's forward pass: the same logits and the
same cache contents, bit for bit (decode.py's invariant).

model.py's path is `Model._forward` on one row, what `forward_step` ran before the
decoder existed (and still runs with `profile` or `check_numerics` set).  Each case
decodes a few tokens after a prompt with both, each into its own cache.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from fucina_course import NonFiniteValues
from fucina_course.attention import Segment
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


def model_path_step(model: Model, token: int, cache) -> np.ndarray:
    """model.py's forward pass for one token at cache.len."""
    seg = Segment(0, 1, cache.len, cache)
    return model._forward(np.array([token]), [seg], last_only=True)[0]


def assert_same_decode(model: Model, prompt, tokens, cache_type="f16"):
    """Prefill `prompt` into two caches, then decode `tokens` through the decoder in
    one and through model.py in the other: every step's logits and every cached row
    equal."""
    ours, ref = (model.new_cache(len(prompt) + len(tokens), cache_type) for _ in "ab")
    model.forward_step(prompt, 0, ours)
    model.forward_step(prompt, 0, ref)
    for t in tokens:
        a = model.forward_step([t], ours.len, ours)
        b = model_path_step(model, t, ref)
        assert np.array_equal(a, b), f"token {t} at {ref.len - 1}: max |diff| " \
                                     f"{np.abs(a - b).max():.3g}"
    assert ours.len == ref.len
    stores = ["k", "v"] + (["k_scale", "v_scale"] if cache_type == "q8_0" else [])
    for name in stores:
        for layer, (x, y) in enumerate(zip(getattr(ours, name), getattr(ref, name))):
            assert np.array_equal(x[:ours.len], y[:ref.len]), (name, layer)
    assert model._decode is not None and model._decode.level == isa.level


def _ids(n: int, seed: int, vocab: int = 4093) -> list[int]:
    return np.random.default_rng(seed).integers(0, vocab, size=n).tolist()


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_format_decodes_as_model_py(fmt, synth_dir):
    assert_same_decode(load(tiny_model(fmt, synth_dir)), _ids(7, 1), _ids(5, 2))


@pytest.mark.parametrize("fmt", MOE_FORMATS)
def test_mixture_of_experts_decodes_as_model_py(fmt, synth_dir):
    assert_same_decode(load(tiny_moe_model(fmt, synth_dir)), _ids(7, 3), _ids(5, 4))


@pytest.mark.parametrize("level", isa.LEVELS)
def test_every_level_decodes_as_model_py(level, synth_dir, monkeypatch):
    """The decoder is remade when the level changes (its kernels are bound to one)."""
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
    """Positions on both sides of a RoPE table block boundary (decode.ROPE_BLOCK)."""
    model = load(tiny_model("Q8_0", synth_dir))
    assert_same_decode(model, _ids(250, 9), _ids(12, 10))


@pytest.mark.parametrize("name", ["coder", "smollm"])
def test_real_models_decode_as_model_py(name, coder_path, smollm_path):
    """Qwen2.5-Coder (qwen2: q/k/v biases, q+k and v in two formats, so two kernel
    calls) and SmolLM2 (llama: "normal" RoPE pairs)."""
    model = load(coder_path if name == "coder" else smollm_path)
    prompt = model.tokenizer.encode("The capital of France is")
    assert_same_decode(model, prompt, _ids(6, 11, 1000))


def test_switches_and_a_busy_decoder_take_model_py(synth_dir):
    """profile and check_numerics need model.py's stages, fast_decode=False asks for
    them, and a decoder in use by another thread is not waited for.  The numbers are
    the same either way."""
    model = load(tiny_model("Q8_0", synth_dir))
    prompt, tok = _ids(5, 12), 17
    cache = model.new_cache(8)
    model.forward_step(prompt, 0, cache)
    expected = model.forward_step([tok], 5, cache)
    decoder = model._decode

    def step():
        cache.truncate(5)
        return model.forward_step([tok], 5, cache)

    for name, on, off in (("profile", {}, None), ("check_numerics", True, False),
                          ("fast_decode", False, True)):
        setattr(model, name, on)
        try:
            assert np.array_equal(step(), expected), name
            if name == "profile":
                assert set(model.profile) == {"embedding", "attention", "ffn", "lm_head"}
        finally:
            setattr(model, name, off)

    held = threading.Event()
    release = threading.Event()

    def hold():
        with decoder.lock:
            held.set()
            release.wait(30)

    holder = threading.Thread(target=hold)
    holder.start()
    held.wait(30)
    try:
        assert np.array_equal(step(), expected)
    finally:
        release.set()
        holder.join()
    assert model._decode is decoder


def test_non_finite_activations_name_the_stage(synth_dir):
    """An infinite norm weight: the decoder reports it as model.py does."""
    model = Model.load(tiny_model("Q8_0", synth_dir))
    bad = np.array(model.layers[1].ffn_norm)
    bad[3] = np.inf
    model.layers[1].ffn_norm = bad
    errors = []
    for profile in (None, {}):                      # the decoder, then model.py
        model.profile = profile
        with pytest.raises(NonFiniteValues, match="non-finite in the ffn stage") as e:
            model.forward_step([3], 0, model.new_cache(4))
        errors.append(str(e.value))
    model.profile = None
    assert errors[0] == errors[1] and model._decode is not None
