"""One check per definition the chapters save: what `fucina course check` runs on a reader's code.

Each check is the assertion its chapter makes, against an independent reference: the engine's
own function (tokenizer, RMSNorm, RoPE, sampler, cache, router, forward pass), gguf-py's
dequantizer, or a float64 loop written out here. The models are the tiny synthetic Qwen3 (and
Qwen3-MoE) the engine writes on first use, so the whole set runs in seconds; only the chat
template and the tokenizer read the default model's file (its metadata, not its weights).

A check gets `course(name)`, the mixed `course.<name>` module of `workbook.environment` (the
reader's definition under test, the book's for the rest), and the shared fixtures
(`workbook_checks.Fixtures`). It raises AssertionError with a short message naming the first
mismatch; workbook_checks.py runs the checks and turns anything else into one line pointing at
the reader's file. tests/test_workbook.py runs every check on the book's code (they must pass)
and on deliberately broken versions (they must fail).
"""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace
from collections.abc import Callable

import numpy as np

CHECKS: dict[tuple[str, str], Callable] = {}

TRICKY_TEXTS = [
    "Hello, world! It's 2026; I'll pay 1234.56 euros.",
    "def area(r):\n    return 3.14159 * r**2\n\n\n",
    "naïve café 日本語 Привет 🦊  tabs\tand   spaces \r\n",
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa 7777777777 !!!???",
    "I'M YOU'RE they've we'd   ",
]


def check(module: str, name: str):
    def register(fn):
        CHECKS[(module, name)] = fn
        return fn
    return register


def same(actual, expected, what: str, rtol: float = 0.0, atol: float = 0.0) -> None:
    """Arrays equal within tolerances, or AssertionError naming the first place they differ."""
    actual, expected = np.asarray(actual), np.asarray(expected)
    if actual.shape != expected.shape:
        raise AssertionError(f"{what}: shape {actual.shape}, expected {expected.shape}")
    bad = ~np.isclose(actual, expected, rtol=rtol, atol=atol, equal_nan=True)
    if bad.any():
        at = tuple(int(i) for i in np.argwhere(bad)[0])
        raise AssertionError(f"{what}: at {list(at)} got {actual[at]:.6g}, expected "
                             f"{expected[at]:.6g} ({int(bad.sum())} of {bad.size} differ)")


def equal(actual, expected, what: str) -> None:
    if actual != expected:
        a, e = repr(actual), repr(expected)
        raise AssertionError(f"{what}: got {a[:70]}, expected {e[:70]}")


TINY_IDS = np.random.default_rng(42).integers(0, 4093, size=24).tolist()
RNG_SEED = 20261204


def _rng():
    return np.random.default_rng(RNG_SEED)


def _relative_gap(ours, engine) -> float:
    return float(np.abs(np.asarray(ours) - engine).max() / (engine.max() - engine.min()))


# --- chapter 1 ---------------------------------------------------------------------------

@check("machine", "cpu_description")
def _(course, fx):
    from .quant.isa import cpu_flags, cpu_name
    name, level = course("machine").cpu_description()
    flags = cpu_flags()
    if flags:                                   # a /proc/cpuinfo to compare with
        equal(name, cpu_name(), "processor name")
    if "avx512f" in flags:
        assert level.startswith("AVX-512"), f"level {level!r}: the CPU has avx512f"
    elif {"avx2", "fma"} <= flags:
        assert level.startswith("AVX2"), f"level {level!r}: the CPU has avx2 and fma"
    elif "asimd" in flags:
        assert level.startswith("NEON"), f"level {level!r}: the CPU has asimd (NEON)"


@check("machine", "machine_label")
def _(course, fx):
    from .quant.isa import cpu_name
    label = course("machine").machine_label(3, "generic")
    name = cpu_name() if Path("/proc/cpuinfo").exists() else ""
    for part in (name, f"{os.cpu_count()} cores", "3 threads", "'generic'"):
        assert part in label, f"{part!r} missing from {label!r}"


# --- chapter 2 ---------------------------------------------------------------------------

@check("tokenizer", "gpt2_byte_map")
def _(course, fx):
    from .tokenizer import bytes_to_unicode
    mine, theirs = course("tokenizer").gpt2_byte_map(), bytes_to_unicode()
    for b in range(256):
        equal(mine.get(b), theirs[b], f"byte {b}")


@check("tokenizer", "pretokenize")
def _(course, fx):
    from .pretokenizer import for_gguf_name
    engine = for_gguf_name("qwen2")
    for text in TRICKY_TEXTS:
        equal(course("tokenizer").pretokenize(text), engine.split(text), f"chunks of {text!r}")


@check("tokenizer", "bpe_encode")
def _(course, fx):
    from .pretokenizer import for_gguf_name
    tok = fx.tokenizer
    ranks = tok._merge_ranks()
    chunks = [c.encode() for t in TRICKY_TEXTS for c in for_gguf_name("qwen2").split(t)]
    for chunk in chunks + [b"", b"x", bytes(range(200, 256))]:
        equal(course("tokenizer").bpe_encode(chunk, ranks), tok.bpe(chunk) if chunk else [],
              f"parts of {chunk!r}")


# --- chapter 3 ---------------------------------------------------------------------------

@check("forward", "float_weights")
def _(course, fx):
    from .synth import TINY_QWEN3
    from gguf.quants import dequantize
    g = fx.synthetic(TINY_QWEN3, "Q8_0")
    mine = course("forward").float_weights(g)
    equal(sorted(mine), sorted(g.tensors), "tensor names")
    for name, t in g.tensors.items():
        expected = dequantize(np.asarray(t.data).reshape(-1), t.ggml_type).reshape(
            t.shape[::-1])
        assert mine[name].dtype == np.float32, f"{name}: dtype {mine[name].dtype}"
        same(mine[name], expected, name)        # gguf-py's dequantizer, exactly


@check("forward", "rms_norm")
def _(course, fx):
    from .ops import rms_norm
    rng = _rng()
    for shape in [(5, 64), (3, 4, 32)]:
        x = rng.standard_normal(shape, dtype=np.float32) * 3
        w = rng.uniform(0.5, 1.5, shape[-1]).astype(np.float32)
        same(course("forward").rms_norm(x, w, 1e-6), rms_norm(x, w, 1e-6),
             f"rms_norm of {list(shape)}", rtol=1e-5, atol=1e-6)


@check("forward", "rope")
def _(course, fx):
    from .ops import apply_rope, rope_angles
    x = _rng().standard_normal((6, 4, 64), dtype=np.float32)
    for start in (0, 37):
        positions = np.arange(start, start + 6)
        cos, sin = rope_angles(positions, 64, 1e6)
        same(course("forward").rope(x, positions, 1e6), apply_rope(x, cos, sin, "neox"),
             f"rope at positions {start}..{start + 5}", atol=1e-4)


@check("forward", "swiglu")
def _(course, fx):
    from .ops import swiglu
    gate, up = _rng().standard_normal((2, 4, 96), dtype=np.float32) * 4
    same(course("forward").swiglu(gate, up), swiglu(gate, up), "swiglu", rtol=1e-5,
         atol=1e-6)


def _naive_attention(q, k, v, scale):
    """float64 loops: query i of the last n of m positions sees keys 0 .. m - n + i."""
    n, heads, d = q.shape
    m, group = len(k), heads // k.shape[1]
    out = np.zeros((n, heads, d))
    probs = np.zeros((heads, n, m))
    for h in range(heads):
        for i in range(n):
            seen = m - n + i + 1
            s = [float(np.dot(q[i, h], k[j, h // group])) * scale for j in range(seen)]
            e = np.exp(np.array(s) - max(s))
            probs[h, i, :seen] = e / e.sum()
            out[i, h] = probs[h, i, :seen] @ v[:seen, h // group].astype(np.float64)
    return out, probs


@check("forward", "attention")
def _(course, fx):
    q, k, v = (_rng().standard_normal((5, h, 16), dtype=np.float32) for h in (4, 2, 2))
    expected, _ = _naive_attention(q, k, v, 1 / 4)
    same(course("forward").attention(q, k, v), expected.reshape(5, 64),
         "attention of 5 positions, 4 query heads on 2 KV heads", rtol=1e-4, atol=1e-5)


@check("forward", "forward")
def _(course, fx):
    cfg = fx.tiny_engine.config
    ours = course("forward").forward(fx.tiny_weights, cfg, TINY_IDS)
    engine = fx.tiny_engine.forward_last_logits(TINY_IDS)
    gap = _relative_gap(ours, engine)
    assert gap < 1e-3, f"scores differ from the engine's by {gap:.2g} of their range"


# --- chapter 5 ---------------------------------------------------------------------------

@check("attention", "softmax")
def _(course, fx):
    s = _rng().standard_normal((4, 7)).astype(np.float32) * 5
    s[1, 3:] = -np.inf                                  # masked scores
    s[2] += 1000                                        # must not overflow
    e = np.exp(s.astype(np.float64) - s.max(axis=-1, keepdims=True))
    same(course("attention").softmax(s), e / e.sum(axis=-1, keepdims=True), "softmax",
         rtol=1e-5, atol=1e-7)


@check("attention", "attention_head")
def _(course, fx):
    q, k, v = (_rng().standard_normal((n, 1, 16), dtype=np.float32) for n in (3, 5, 5))
    expected, probs = _naive_attention(q, k, v, 0.25)
    out, p = course("attention").attention_head(q[:, 0], k[:, 0], v[:, 0], 0.25)
    same(p, probs[0], "probabilities (3 queries, the last 3 of 5 positions)",
         rtol=1e-5, atol=1e-7)
    same(out, expected[:, 0], "output", rtol=1e-4, atol=1e-5)


@check("attention", "grouped_attention")
def _(course, fx):
    q, k, v = (_rng().standard_normal((n, h, 16), dtype=np.float32)
               for n, h in ((3, 4), (5, 2), (5, 2)))
    expected, probs = _naive_attention(q, k, v, 0.25)
    out, p = course("attention").grouped_attention(q, k, v, 0.25)
    same(p, probs, "probabilities [head, query, key]", rtol=1e-5, atol=1e-7)
    same(out, expected.reshape(3, 64), "output", rtol=1e-4, atol=1e-5)


# --- chapter 6 ---------------------------------------------------------------------------

@check("kv_cache", "CourseKvCache")
def _(course, fx):
    from .errors import KvCacheOverflow
    from .kv_cache import KvCache
    cfg = SimpleNamespace(num_layers=2, num_kv_heads=2, head_dim=8)
    mine = course("kv_cache").CourseKvCache(cfg, 6)
    engine = KvCache.for_config(cfg, 6)
    rng = _rng()
    for step, n in enumerate([3, 2, -4, 1]):
        if n < 0:                                        # truncate to -n positions
            mine.truncate(-n)
            engine.truncate(-n)
            continue
        for layer in range(2):
            k, v = rng.standard_normal((2, n, 2, 8), dtype=np.float32)
            mine.append_layer(layer, k, v)
            engine.append_layer(layer, k, v)
        mine.advance(n)
        engine.advance(n)
        equal(mine.len, engine.len, f"len after step {step}")
        equal(mine.remaining, engine.remaining, f"remaining after step {step}")
        for layer in range(2):
            for got, want, what in zip(mine.read(layer, mine.len),
                                       engine.read(layer, engine.len), "KV"):
                same(got, want, f"{what} of layer {layer} after step {step}")
    view = mine.layer_view(1, mine.len)
    same(view.k[:mine.len], engine.layer_view(1, engine.len).k[:engine.len],
         "layer_view keys (float16 bits)")
    try:
        mine.check_room(mine.remaining + 1)
    except KvCacheOverflow:
        pass
    else:
        raise AssertionError("check_room(remaining + 1) did not raise KvCacheOverflow")


@check("kv_cache", "filled_cache")
def _(course, fx):
    model = fx.tiny_engine
    cache = course("kv_cache").filled_cache(model, 512)
    equal(cache.len, 512, "positions held")
    assert cache.remaining >= 1, "no room left for a step's own row"
    logits = model.forward_step([1], cache.len, cache)
    assert np.isfinite(logits).all(), "a step on the filled cache gave non-finite scores"


# --- chapter 8 ---------------------------------------------------------------------------

SAMPLER_CASES = [
    dict(temperature=0.7, top_k=20, top_p=0.95),
    dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.05),
    dict(temperature=0.6, top_k=40, top_p=0.8, repeat_penalty=1.3, presence_penalty=0.5,
         frequency_penalty=0.2, last_n=8),
    dict(temperature=0.0),
]


@check("sampling", "course_distribution")
def _(course, fx):
    from .sampler import Sampler, SamplerConfig
    rng = _rng()
    logits = (rng.standard_normal(1000) * 3).astype(np.float32)
    history = rng.integers(0, 1000, 40).tolist() + [int(np.argmax(logits))] * 3
    for knobs in SAMPLER_CASES:
        config = SamplerConfig(**{"repeat_last_n" if k == "last_n" else k: v
                                  for k, v in knobs.items()},
                               **({} if "min_p" in knobs else {"min_p": 0.0}), seed=0)
        want = Sampler(config).distribution(logits, history)
        ids, probs = course("sampling").course_distribution(logits, history, **knobs)
        equal(list(map(int, ids)), want.ids.tolist(), f"candidates with {knobs}")
        same(probs, want.probs, f"probabilities with {knobs}", rtol=1e-5, atol=1e-9)


@check("sampling", "course_draw")
def _(course, fx):
    from .sampler import draw
    probs = np.array([2.0, 1.0, 0.5, 0.5])              # not normalized: total 4
    for u in np.linspace(0, 0.999, 37):
        equal(course("sampling").course_draw(probs, u), draw(probs, u), f"u = {u:.3f}")


# --- chapter 9 ---------------------------------------------------------------------------

@check("chat", "course_chatml")
def _(course, fx):
    from .chat_template import ChatTemplate
    template = ChatTemplate(fx.vocab_gguf.get_str("tokenizer.chat_template"))
    conversations = [
        [{"role": "user", "content": "What is the capital of France?"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
         {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}],
    ]
    for messages in conversations:
        for gen in (True, False):
            equal(course("chat").course_chatml(messages, add_generation_prompt=gen),
                  template.render(messages, add_generation_prompt=gen),
                  f"{len(messages)} messages, add_generation_prompt={gen}")


# --- chapter 10 --------------------------------------------------------------------------

@check("moe", "course_route")
def _(course, fx):
    from . import moe
    logits = _rng().standard_normal((6, 8)).astype(np.float32)
    ties = np.array([[1, 5, 5, 2, 5, 0, 5, 5], [3] * 8], np.float32)
    for case in (logits, ties):
        for normalize in (True, False):
            experts, weights = course("moe").course_route(case, 2, normalize)
            want = moe.route(case, 2, normalize)
            equal(np.asarray(experts).tolist(), want[0].tolist(),
                  f"experts (normalize={normalize})")
            same(weights, want[1], f"weights (normalize={normalize})", rtol=1e-5,
                 atol=1e-7)


@check("moe", "course_moe")
def _(course, fx):
    ffn = fx.tiny_moe_engine.layers[0].ffn
    h = _rng().standard_normal((5, fx.tiny_moe_engine.config.hidden_size),
                               dtype=np.float32)
    want = ffn(h, "rows")
    big = float(np.abs(want).max())
    same(course("moe").course_moe(ffn, h), want, "the MoE layer's output", rtol=1e-5,
         atol=1e-5 * big)


# --- chapter 11 --------------------------------------------------------------------------

@check("build_it", "course_config")
def _(course, fx):
    cfg, engine = course("build_it").course_config(fx.tiny_gguf), fx.tiny_engine.config
    for field in ("num_layers", "num_heads", "num_kv_heads", "head_dim", "rope_theta",
                  "rms_norm_eps"):
        got = getattr(cfg, field, None)
        assert got is not None and np.isclose(got, getattr(engine, field)), \
            f"{field}: got {got}, expected {getattr(engine, field)}"


@check("build_it", "CourseTokenizer")
def _(course, fx):
    tok = course("build_it").CourseTokenizer(fx.vocab_gguf)
    for text in TRICKY_TEXTS:
        ids = tok.encode(text)
        equal(ids, fx.tokenizer.encode(text), f"ids of {text!r}")
        equal(tok.decode(ids), text, "decode(encode(text))")
    stop = {fx.tokenizer.token_id("<|im_end|>"), fx.tokenizer.token_id("<|endoftext|>")}
    equal(set(tok.stop), stop, "stop ids")


@check("build_it", "linear")
def _(course, fx):
    x, w, b = _rng().standard_normal((3, 16)), _rng().standard_normal((8, 16)), np.arange(8.)
    same(course("build_it").linear(x, w, b), x @ w.T + b, "x @ w.T + bias", rtol=1e-10)
    same(course("build_it").linear(x[:1], w), x[:1] @ w.T, "one row, no bias", rtol=1e-10)


def _course_model(course, fx):
    m = course("build_it")
    return m.CourseModel(m.course_config(fx.tiny_gguf), fx.tiny_weights)


@check("build_it", "CourseModel")
def _(course, fx):
    mine, engine = _course_model(course, fx), fx.tiny_engine
    caches = mine.new_cache(32), engine.new_cache(32)
    rows = mine.forward_step_all_logits(TINY_IDS, 0, caches[0])
    want = engine.forward_step_all_logits(TINY_IDS, 0, caches[1])
    gap = _relative_gap(rows, want)
    assert gap < 1e-3, f"prefill scores differ from the engine's by {gap:.2g} of their range"
    equal(caches[0].len, len(TINY_IDS), "cache.len after the prefill")
    last = mine.forward_step([7], len(TINY_IDS), caches[0])
    gap = _relative_gap(last, engine.forward_step([7], len(TINY_IDS), caches[1]))
    assert gap < 1e-3, f"a cached step's scores differ by {gap:.2g} of their range"
    others = mine.new_cache(8), engine.new_cache(8)           # a second, shorter sequence
    mine.forward_step(TINY_IDS[:3], 0, others[0])
    engine.forward_step(TINY_IDS[:3], 0, others[1])
    rows = mine.forward_step_batch([9, 11], [caches[0], others[0]])
    want = engine.forward_step_batch([9, 11], [caches[1], others[1]])
    gap = _relative_gap(rows, want)
    assert gap < 1e-3, f"a batch step's scores differ by {gap:.2g} of their range"
    equal([caches[0].len, others[0].len], [len(TINY_IDS) + 2, 4], "cache.len after a batch")


@check("build_it", "generate")
def _(course, fx):
    model = _course_model(course, fx)
    want = fx.greedy(TINY_IDS, 8)
    seen, trace = [], []
    out = course("build_it").generate(model, TINY_IDS, max_tokens=8, trace=trace,
                                      on_token=seen.append)
    equal(out, want, "greedy tokens (the engine's)")
    equal(seen, out, "the ids on_token received")
    equal(len(trace), len(out), "scores traced (one per token)")
    stop = {want[2]}
    out = course("build_it").generate(model, TINY_IDS, stop=stop, max_tokens=8)
    equal(out, want[:3], f"tokens with stop={stop} (up to and including it)")


@check("build_it", "ask")
def _(course, fx):
    m = course("build_it")
    tok, model = m.CourseTokenizer(fx.tiny_gguf), _course_model(course, fx)
    question = "What is the capital of France?"
    ids = fx.tiny_engine.tokenizer.encode(
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
        f"assistant.<|im_end|>\n<|im_start|>user\n{question}<|im_end|>\n"
        "<|im_start|>assistant\n")
    want = fx.greedy(ids, 6, stop=tok.stop)
    text, out = m.ask(model, tok, question, max_tokens=6)
    equal(out, want, "answer ids (the engine's greedy ones)")
    equal(text, fx.tiny_engine.tokenizer.decode([t for t in want if t not in tok.stop]),
          "answer text")


# --- chapter 14 --------------------------------------------------------------------------

@check("speculative", "course_lookup")
def _(course, fx):
    from .speculative import PromptLookup
    rng = _rng()
    for trial in range(40):
        tokens = rng.integers(0, 5, int(rng.integers(2, 30))).tolist()
        limit, nmax = int(rng.integers(1, 6)), int(rng.integers(1, 4))
        nmin = int(rng.integers(1, nmax + 1))
        want = PromptLookup(nmax, nmin).propose(tokens, limit).ids
        equal(list(course("speculative").course_lookup(tokens, limit, nmax, nmin)),
              list(want), f"lookup in {tokens} (limit {limit}, n {nmax}..{nmin})")


@check("speculative", "course_speculative_generate")
def _(course, fx):
    prompt = (TINY_IDS[:8] * 3)[:20]                  # repeats: the lookup finds guesses
    out, accepted = course("speculative").course_speculative_generate(
        fx.tiny_engine, prompt, 16)
    equal(out, fx.greedy(prompt, 16), "tokens (one-at-a-time greedy decoding's)")
    assert len(accepted) <= len(out), f"{len(accepted)} verify steps for {len(out)} tokens"


@check("speculative", "course_accept")
def _(course, fx):
    accept = course("speculative").course_accept
    p = np.array([0.5, 0.3, 0.2, 0.0])
    q = np.array([0.0, 0.1, 0.1, 0.8])               # proposes 3, which p never picks
    rng = np.random.default_rng(0)
    drawn = [accept(p, q, int(rng.choice(4, p=q)), rng) for _ in range(20_000)]
    freq = np.bincount(drawn, minlength=4) / len(drawn)
    same(freq, p, "frequencies of the accepted tokens (should follow p)", atol=0.02)
