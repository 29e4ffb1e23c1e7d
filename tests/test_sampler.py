"""The sampler: each stage against llama.cpp's sampler of the same name, the whole
chain against llama.cpp's chain with the same seed, determinism, and the draw's
statistics against `Sampler.distribution`.

llama.cpp is driven through its low-level C API (`llama_sampler_init_*` and
`llama_sampler_apply` on a `llama_token_data_array`), so no model is needed: the
candidates are random logit vectors, 1,000 per stage.
"""

from __future__ import annotations

import ctypes
import math

import numpy as np
import pytest

from fucina_course.errors import FucinaError
from fucina_course.sampler import (InvalidSamplerConfig, Mt19937Uniform, Sampler,
                                   SamplerConfig, apply_logit_bias, apply_penalties,
                                   draw, min_p, softmax, top_k, top_p)

N_VECTORS = 1000
VOCAB = 4096
TOKEN_DATA = np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])


def random_logits(rng, n=VOCAB):
    """Logit vectors of varied shape: sharp, flat, heavy-tailed."""
    kind = rng.integers(3)
    scale = rng.uniform(0.3, 8.0)
    if kind == 0:
        x = rng.standard_normal(n) * scale
    elif kind == 1:
        x = rng.standard_t(3, n) * scale
    else:
        x = rng.standard_normal(n) * 0.5 + np.where(rng.random(n) < 0.01, scale * 3, 0)
    return x.astype(np.float32)


class Llama:
    """llama.cpp's samplers applied to a candidate array we build ourselves."""

    def __init__(self, llama_cpp):
        assert TOKEN_DATA.itemsize == ctypes.sizeof(llama_cpp.llama_token_data)
        self.L = llama_cpp
        self._owned = []

    def __getattr__(self, name):  # top_k(k) -> llama_sampler_init_top_k(k)
        init = getattr(self.L, f"llama_sampler_init_{name}")

        def make(*args):
            s = init(*args)
            self._owned.append(s)
            return s
        return make

    def apply(self, samplers, ids, logits, *, is_sorted=False):
        """Run `samplers` in order; return the surviving (ids, logits, p) and the
        selected index (-1 if none of them selects)."""
        a = np.zeros(len(ids), TOKEN_DATA)
        a["id"], a["logit"] = ids, logits
        cur = self.L.llama_token_data_array(
            data=a.ctypes.data_as(self.L.llama_token_data_p), size=len(a), selected=-1,
            sorted=is_sorted)
        for s in samplers:
            self.L.llama_sampler_apply(s, ctypes.byref(cur))
        out = a[:cur.size].copy()
        return out, int(cur.selected)

    def free(self):
        for s in self._owned:
            self.L.llama_sampler_free(s)
        self._owned.clear()


def assert_same_candidates(out, ids, values):
    """Same values in the same order, and the same ids -- up to the order of equal
    values, which llama.cpp leaves unspecified (`std::partial_sort`) and we fix to
    the lower id first; at the cut, equal values may keep different ids."""
    assert np.array_equal(out["logit"], values)
    theirs = out["id"][np.lexsort((out["id"], -out["logit"]))]
    cut = values[-1]
    inside = values != cut
    assert theirs[inside].tolist() == ids[inside].tolist()


@pytest.fixture
def llama(llama_cpp):
    oracle = Llama(llama_cpp)
    yield oracle
    oracle.free()


# --- each stage against llama.cpp ----------------------------------------------------

def test_top_k_matches_llama(llama):
    rng = np.random.default_rng(1)
    for _ in range(N_VECTORS):
        x = random_logits(rng)
        k = int(rng.choice([1, 2, 5, 20, 40, 128, 129, 300, 1000]))
        ids, values = top_k(x, k)
        out, _ = llama.apply([llama.top_k(k)], np.arange(VOCAB), x)
        assert_same_candidates(out, ids, values)


def test_temperature_softmax_matches_llama(llama):
    """top-k, temp, then dist: llama.cpp's probabilities of the scaled candidates
    (dist normalizes with a float64 sum, like our final renormalization)."""
    rng = np.random.default_rng(2)
    for _ in range(N_VECTORS):
        x = random_logits(rng)
        k, t = int(rng.integers(1, 300)), float(rng.uniform(0.05, 3.0))
        out, _ = llama.apply([llama.top_k(k), llama.temp(t), llama.dist(7)],
                             np.arange(VOCAB), x)
        ids, values = top_k(x, k)
        assert_same_candidates(out, ids, values / np.float32(t))  # bit for bit
        cfg = SamplerConfig(temperature=t, top_k=k, top_p=1.0, min_p=0.0)
        d_ids, d_probs = Sampler(cfg).distribution(x)
        assert d_ids.tolist() == ids.tolist()
        order = np.lexsort((out["id"], -out["logit"]))
        assert np.abs(out["p"][order] - d_probs).max() < 1e-6


def test_top_p_matches_llama(llama):
    rng = np.random.default_rng(3)
    for _ in range(N_VECTORS):
        ids, values = top_k(random_logits(rng), int(rng.integers(1, 300)))
        t, p = float(rng.uniform(0.2, 2.0)), float(rng.uniform(0.01, 1.0))
        out, _ = llama.apply([llama.temp(t), llama.top_p(p, 1)], ids, values,
                             is_sorted=True)
        probs = softmax(values / np.float32(t))
        n = top_p(probs, p)
        assert out["id"].tolist() == ids[:n].tolist()
        if p < 1:  # llama.cpp only computes probabilities when the stage is active
            assert np.abs(out["p"] - probs[:n]).max() < 1e-6


def test_min_p_matches_llama(llama):
    """min_p, then dist for the renormalized probabilities of the survivors."""
    rng = np.random.default_rng(4)
    for _ in range(N_VECTORS):
        ids, values = top_k(random_logits(rng), int(rng.integers(1, 300)))
        t, p = float(rng.uniform(0.2, 2.0)), float(rng.uniform(0.0, 0.6))
        out, _ = llama.apply([llama.temp(t), llama.min_p(p, 1), llama.dist(1)], ids,
                             values, is_sorted=True)
        scaled = values / np.float32(t)
        n = min_p(scaled, p)
        assert out["id"].tolist() == ids[:n].tolist()
        kept = softmax(scaled[:n])
        assert np.abs(out["p"] - kept).max() < 1e-6


def test_penalties_match_llama(llama):
    rng = np.random.default_rng(5)
    for _ in range(N_VECTORS):
        x = random_logits(rng, 512)
        history = rng.integers(0, 512, int(rng.integers(0, 200))).tolist()
        cfg = SamplerConfig(repeat_penalty=float(rng.uniform(0.5, 2.0)),
                            frequency_penalty=float(rng.uniform(-1, 1)),
                            presence_penalty=float(rng.uniform(-1, 1)),
                            repeat_last_n=int(rng.choice([-1, 1, 8, 64, 500])))
        last_n = len(history) if cfg.repeat_last_n == -1 else cfg.repeat_last_n
        s = llama.penalties(512, max(last_n, 1), cfg.repeat_penalty,
                            cfg.frequency_penalty, cfg.presence_penalty)
        for tid in history:
            llama.L.llama_sampler_accept(s, tid)
        out, _ = llama.apply([s], np.arange(512), x)
        ours = apply_penalties(x, history, cfg)
        assert np.array_equal(out["logit"], ours)


def llama_bias(llama, bias: dict, n_vocab: int = VOCAB):
    """llama.cpp's `logit_bias` sampler over {id: bias} (it copies the array)."""
    L = llama.L
    arr = (L.llama_logit_bias * len(bias))(*[L.llama_logit_bias(token=t, bias=b)
                                             for t, b in bias.items()])
    return llama.logit_bias(n_vocab, len(bias), arr)


def test_logit_bias_matches_llama(llama):
    """The stage alone: llama.cpp's `logit_bias` sampler, bit for bit."""
    rng = np.random.default_rng(16)
    for _ in range(200):
        x = random_logits(rng)
        n = int(rng.integers(1, 50))
        ids = rng.choice(VOCAB, n, replace=False)
        bias = {int(t): float(np.float32(rng.uniform(-100, 100))) for t in ids}
        out, _ = llama.apply([llama_bias(llama, bias)], np.arange(VOCAB), x)
        ours = apply_logit_bias(x, list(bias), list(bias.values()))
        assert np.array_equal(out["logit"], ours)


def test_logit_bias_first_in_the_chain_draws_the_same_tokens_as_llama(llama):
    """logit_bias -> penalties -> top-k -> temp -> top-p -> min-p -> dist: llama.cpp's
    own order for logit_bias (common_sampler puts it first), 1,000 seeded tokens;
    the biases change what is drawn."""
    rng = np.random.default_rng(17)
    vectors = repetitive_logits(rng)
    favourites = np.argsort(-vectors[0])[:40]
    bias = {int(t): float(b) for t, b in zip(favourites[::2], rng.uniform(-6, 3, 20))}
    bias[int(rng.integers(VOCAB))] = 8.0
    cfg = SamplerConfig(temperature=0.9, top_k=40, top_p=0.9, min_p=0.02,
                        presence_penalty=0.4, repeat_last_n=32, seed=21,
                        logit_bias=bias)
    chain = [llama_bias(llama, bias), llama.penalties(VOCAB, 32, 1.0, 0.0, 0.4),
             llama.top_k(40), llama.temp(0.9), llama.top_p(0.9, 1),
             llama.min_p(0.02, 1), llama.dist(21)]
    ours, theirs = run_both(llama, cfg, chain, vectors)
    assert ours == theirs
    plain = Sampler(cfg.with_(logit_bias=()))
    assert [plain.next(x) for x in vectors] != ours


def test_whole_chain_draws_the_same_tokens_as_llama(llama):
    """penalties -> top-k -> temp -> top-p -> min-p -> dist, same seed: the same
    1,000 tokens, because the random stream is llama.cpp's own."""
    rng = np.random.default_rng(6)
    cfg = SamplerConfig(temperature=0.9, top_k=50, top_p=0.9, min_p=0.02,
                        repeat_penalty=1.3, presence_penalty=0.2, repeat_last_n=16,
                        seed=1234)
    ours = Sampler(cfg)
    chain = [llama.penalties(VOCAB, 16, 1.3, 0.0, 0.2), llama.top_k(50),
             llama.temp(0.9), llama.top_p(0.9, 1), llama.min_p(0.02, 1),
             llama.dist(1234)]
    history, theirs_picks, our_picks = [], [], []
    for _ in range(N_VECTORS):
        x = random_logits(rng)
        out, sel = llama.apply(chain, np.arange(VOCAB), x)
        theirs = int(out["id"][sel])
        mine = ours.next(x, history)
        for s in chain:
            llama.L.llama_sampler_accept(s, theirs)
        history.append(theirs)
        theirs_picks.append(theirs)
        our_picks.append(mine)
    assert our_picks == theirs_picks


def run_both(llama, cfg, chain, vectors):
    """Sample with our `Sampler` and llama.cpp's `chain` side by side, each token
    accepted into llama.cpp's samplers (the penalties' window) and into our history;
    return (ours, theirs)."""
    ours_s, history, ours, theirs = Sampler(cfg), [], [], []
    for x in vectors:
        out, sel = llama.apply(chain, np.arange(len(x)), x)
        pick = int(out["id"][sel])
        ours.append(ours_s.next(x, history))
        for s in chain:
            llama.L.llama_sampler_accept(s, pick)
        history.append(pick)
        theirs.append(pick)
    return ours, theirs


def repetitive_logits(rng, n=N_VECTORS):
    """A fixed favourite set plus noise: the same tokens keep winning, so the
    penalties' window is full of repeats and the penalties decide many draws."""
    base = random_logits(rng) * 0.5
    base[rng.choice(VOCAB, 30, replace=False)] += 6.0
    return [base + (0.3 * rng.standard_normal(VOCAB)).astype(np.float32)
            for _ in range(n)]


@pytest.mark.parametrize("knobs", [
    # the Qwen3 card's non-thinking settings with its anti-repetition advice
    dict(temperature=0.7, top_k=20, top_p=0.8, min_p=0.0, presence_penalty=1.5,
         repeat_last_n=64),
    # all three penalties at once, a short window, a negative frequency penalty
    dict(temperature=1.2, top_k=100, top_p=0.95, min_p=0.05, repeat_penalty=1.1,
         frequency_penalty=-0.3, presence_penalty=0.7, repeat_last_n=32),
    dict(temperature=0.9, top_k=40, top_p=0.9, min_p=0.0, frequency_penalty=0.4,
         repeat_last_n=128),
])
def test_presence_and_frequency_penalties_draw_the_same_tokens_as_llama(llama, knobs):
    """Seeded sampling under presence / frequency penalties (the knobs the
    OpenAI-compatible API exposes): llama.cpp's chain, same seed, 1,000 tokens."""
    cfg = SamplerConfig(seed=99, **knobs)
    vectors = repetitive_logits(np.random.default_rng(14))
    chain = [llama.penalties(VOCAB, cfg.repeat_last_n, cfg.repeat_penalty,
                             cfg.frequency_penalty, cfg.presence_penalty),
             llama.top_k(cfg.top_k), llama.temp(cfg.temperature),
             llama.top_p(cfg.top_p, 1), llama.min_p(cfg.min_p, 1), llama.dist(99)]
    ours, theirs = run_both(llama, cfg, chain, vectors)
    assert ours == theirs
    # ... and the penalties decided something: without them the tokens differ.
    plain = Sampler(cfg.with_(repeat_penalty=1.0, frequency_penalty=0.0,
                              presence_penalty=0.0))
    assert [plain.next(x) for x in vectors] != ours


def test_whole_vocabulary_is_llamas_top_k_zero(llama):
    """max_candidates = 0 with top_k = 0 is llama.cpp's top_k = 0: every token stays
    a candidate (top-p sorts them; llama.cpp sorts the 256 best first, then all)."""
    cfg = SamplerConfig(temperature=1.5, top_k=0, top_p=0.95, min_p=0.0,
                        presence_penalty=0.5, repeat_last_n=16, max_candidates=0,
                        seed=5)
    rng = np.random.default_rng(15)
    vectors = [random_logits(rng) for _ in range(300)]
    chain = [llama.penalties(VOCAB, 16, 1.0, 0.0, 0.5), llama.top_k(0),
             llama.temp(1.5),
             llama.top_p(0.95, 1), llama.min_p(0.0, 1), llama.dist(5)]
    ours, theirs = run_both(llama, cfg, chain, vectors)
    assert ours == theirs


def test_frequency_and_presence_penalties_by_hand():
    """count * frequency + presence, subtracted once per distinct token of the
    window, after the repeat penalty's division (or multiplication if <= 0)."""
    x = np.array([2.0, -1.0, 0.5, 3.0, 1.0], np.float32)
    history = [4, 0, 0, 1, 0, 2]           # the window (last 5): 0 x3, 1 x1, 2 x1
    cfg = SamplerConfig(repeat_penalty=2.0, frequency_penalty=0.25,
                        presence_penalty=0.5, repeat_last_n=5)
    out = apply_penalties(x, history, cfg)
    assert out.tolist() == [2.0 / 2 - 3 * 0.25 - 0.5,      # -0.25
                            -1.0 * 2 - 0.25 - 0.5,          # -2.75
                            0.5 / 2 - 0.25 - 0.5,           # -0.5
                            3.0,                            # not in the history
                            1.0]                            # outside the window
    assert x.tolist() == [2.0, -1.0, 0.5, 3.0, 1.0]        # the caller's copy


def test_logit_bias_by_hand():
    """Each bias added to its token's logit before anything else: the distribution
    is the softmax of the biased scores, computed here by hand."""
    x = np.array([1.0, 2.0, 0.5, -1.0], np.float32)
    cfg = SamplerConfig(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0,
                        max_candidates=0, logit_bias={0: 3.0, 1: -100.0, 3: 0.25})
    assert cfg.logit_bias == ((0, 3.0), (1, -100.0), (3, 0.25))   # frozen pairs
    biased = [1.0 + 3.0, 2.0 - 100.0, 0.5, -1.0 + 0.25]
    total = sum(math.exp(v) for v in biased)
    ids, probs = Sampler(cfg).distribution(x)
    order = sorted(range(4), key=lambda i: -biased[i])
    assert ids.tolist() == order
    assert np.allclose(probs, [math.exp(biased[i]) / total for i in order],
                       rtol=1e-6, atol=1e-12)
    assert apply_logit_bias(x, [0, 1, 3], [3.0, -100.0, 0.25]).tolist() == biased
    assert x.tolist() == [1.0, 2.0, 0.5, -1.0]              # the caller's copy


def test_logit_bias_bans_and_forces_under_greedy():
    x = random_logits(np.random.default_rng(18))
    best, second, worst = (int(i) for i in np.argsort(-x)[[0, 1, -1]])
    greedy = SamplerConfig.greedy()
    assert Sampler(greedy).next(x) == best
    assert Sampler(greedy.with_(logit_bias={best: -100})).next(x) == second
    assert Sampler(greedy.with_(logit_bias={worst: 100})).next(x) == worst
    # a banned token never comes back through sampling either
    banned = Sampler(SamplerConfig(temperature=1.5, top_k=0, seed=3,
                                   logit_bias={best: -100.0, second: -100.0}))
    assert not {best, second} & {banned.next(x) for _ in range(300)}


@pytest.mark.parametrize("bias, word", [
    ({-1: 1.0}, "token ids"), ({True: 1.0}, "token ids"), ({"5": 1.0}, "token ids"),
    ({5: float("nan")}, "finite"), ({5: float("inf")}, "finite"), ({5: "1"}, "finite"),
    ([(5, 1.0), (5, 2.0)], "twice"), (7, "mapping"),
])
def test_bad_logit_bias_is_a_one_line_error(bias, word):
    with pytest.raises(InvalidSamplerConfig, match=word) as e:
        SamplerConfig(logit_bias=bias)
    assert "\n" not in str(e.value)


def test_logit_bias_outside_the_vocabulary_is_refused_when_sampling():
    s = Sampler(SamplerConfig(seed=0, logit_bias={10: 1.0}))
    with pytest.raises(FucinaError, match="outside the vocabulary"):
        s.next(np.zeros(10, np.float32))


# --- randomness --------------------------------------------------------------------

def test_uniform_stream_is_std_mt19937_through_libstdcxx():
    # printed by: std::mt19937 rng(42); std::uniform_real_distribution<double> d(0, 1);
    u = Mt19937Uniform(42)
    assert [u() for _ in range(3)] == [0.79654298428784598, 0.18343478789336848,
                                       0.77969099761266125]


def test_same_seed_same_sequence_and_one_draw_per_token():
    rng = np.random.default_rng(7)
    vectors = [random_logits(rng) for _ in range(200)]
    cfg = SamplerConfig(temperature=0.7, seed=42, top_k=0)

    def run(config):
        s, history = Sampler(config), []
        for x in vectors:
            history.append(s.next(x, history))
        assert s.draws == len(vectors)
        return history

    first = run(cfg)
    assert run(cfg) == first
    assert run(cfg.with_(seed=43)) != first
    # Greedy draws too (and discards), so the stream position counts tokens.
    s = Sampler(SamplerConfig.greedy(seed=42))
    picks = [s.next(x) for x in vectors[:10]]
    assert s.draws == 10 and picks == [int(np.argmax(x)) for x in vectors[:10]]


def test_reset_rewinds_and_no_seed_draws_a_fresh_one():
    x = random_logits(np.random.default_rng(8))
    s = Sampler(SamplerConfig(temperature=1.5, seed=5))
    a = [s.next(x) for _ in range(20)]
    s.reset()
    assert [s.next(x) for _ in range(20)] == a
    seeds = {Sampler(SamplerConfig()).seed for _ in range(5)}
    assert len(seeds) > 1 and all(0 <= v < 2**32 for v in seeds)


def chi2_critical(df: int, z: float = 3.09) -> float:
    """Upper 0.1% point of chi-square(df), Wilson-Hilferty approximation."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@pytest.mark.parametrize("config", [
    SamplerConfig(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=11),
    SamplerConfig(temperature=0.7, top_k=20, top_p=0.9, min_p=0.05, seed=12),
    SamplerConfig(temperature=1.3, top_k=8, top_p=1.0, min_p=0.0, repeat_penalty=1.5,
                  seed=13),
])
def test_draws_follow_distribution_chi_square(config):
    rng = np.random.default_rng(9)
    x = (rng.standard_normal(1000) * 2).astype(np.float32)
    history = [int(i) for i in np.argsort(-x)[:3]]
    s = Sampler(config)
    ids, probs = s.distribution(x, history)
    assert abs(probs.sum() - 1) < 1e-12 and np.all(np.diff(probs) <= 1e-12)
    n = 20_000
    picks = [s.next(x, history) for _ in range(n)]
    index = {int(t): i for i, t in enumerate(ids)}
    counts = np.bincount([index[t] for t in picks], minlength=len(ids))
    expected = probs * n
    big = expected >= 5                       # pool the rare tail into one cell
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    obs, exp = obs[exp > 0], exp[exp > 0]
    stat = float(((obs - exp) ** 2 / exp).sum())
    assert stat < chi2_critical(len(obs) - 1), (stat, len(obs))


# --- the pipeline's contracts ------------------------------------------------------

def test_callers_logits_are_never_modified():
    x = random_logits(np.random.default_rng(10))
    before = x.copy()

    def processor(logits, history):
        logits[:10] = -np.inf           # in place, on the sampler's private copy
        return logits

    s = Sampler(SamplerConfig(repeat_penalty=2.0, presence_penalty=1.0, seed=1),
                logit_processor=processor)
    ids, _ = s.distribution(x, list(range(50)))
    s.next(x, list(range(50)))
    assert np.array_equal(x, before)
    assert not set(ids.tolist()) & set(range(10))


def test_ties_go_to_the_lower_id():
    x = np.zeros(1000, np.float32)
    x[[900, 7, 500, 3]] = 5.0
    x[[800, 20]] = 4.0
    ids, _ = top_k(x, 5)
    assert ids.tolist() == [3, 7, 500, 900, 20]
    assert Sampler(SamplerConfig.greedy()).next(x) == 3


def test_stages_keep_at_least_one_and_top_p_one_keeps_all():
    probs = softmax(np.array([10.0, 0.0, -1.0], np.float32))
    assert top_p(probs, 1e-9) == 1 and top_p(probs, 1.0) == 3
    assert min_p(np.array([10.0, 0.0], np.float32), 1.0) == 1
    assert draw(np.array([0.0, 1.0]), 0.0) == 1 or draw(np.array([0.5, 0.5]), 0.0) == 0


@pytest.mark.parametrize("changes, word", [
    (dict(temperature=float("nan")), "temperature"),
    (dict(temperature=float("inf")), "temperature"),
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.01), "top_p"), (dict(top_p=-1), "top_p"),
    (dict(top_k=-1), "top_k"), (dict(top_k=2.5), "top_k"),
    (dict(min_p=-0.1), "min_p"), (dict(min_p=1.5), "min_p"),
    (dict(repeat_penalty=0.0), "repeat_penalty"),
    (dict(repeat_last_n=-2), "repeat_last_n"),
    (dict(seed=-1), "seed"), (dict(seed=2**32), "seed"),
])
def test_bad_config_is_a_one_line_fucina_error(changes, word):
    with pytest.raises(InvalidSamplerConfig, match=word) as e:
        SamplerConfig(**changes)
    assert isinstance(e.value, FucinaError) and "\n" not in str(e.value)


@pytest.mark.parametrize("logits, word", [
    (np.array([0.0, np.nan], np.float32), "NaN"),
    (np.array([0.0, np.inf], np.float32), "inf"),
    (np.full(4, -np.inf, np.float32), "-inf"),
    (np.zeros((2, 3), np.float32), "shape"),
])
def test_bad_logits_are_refused(logits, word):
    with pytest.raises(FucinaError, match=word):
        Sampler(SamplerConfig(seed=0)).next(logits)


def test_history_outside_vocabulary_is_refused():
    s = Sampler(SamplerConfig(repeat_penalty=1.1, seed=0))
    with pytest.raises(FucinaError, match="outside the vocabulary"):
        s.next(np.zeros(10, np.float32), [3, 10])


def test_qwen3_presets():
    assert SamplerConfig.qwen3().temperature == 0.6
    no = SamplerConfig.qwen3(thinking=False)
    assert (no.temperature, no.top_k, no.top_p, no.min_p) == (0.7, 20, 0.8, 0.0)
    assert SamplerConfig() == SamplerConfig(temperature=0.8, top_k=40, top_p=0.95,
                                            min_p=0.05, repeat_last_n=64)


# --- the book's sampler widget, in a real browser ----------------------------------

def test_sampler_widget_agrees_with_the_engine_and_redraws(tmp_path):
    """The widget recomputes the pipeline in JavaScript: it must agree with the
    engine (it checks itself on load) and a slider move must change the plot."""
    sync_api = pytest.importorskip("playwright.sync_api")
    from pathlib import Path

    chromium = Path("/usr/bin/chromium")
    if not chromium.exists():
        pytest.skip("no Chromium at /usr/bin/chromium")
    from fucina_course.catalog import qwen3_tokenizer
    from fucina_course.sampler_widget import sampler_explorer_html

    tok = qwen3_tokenizer()
    rng = np.random.default_rng(12)
    x = (rng.standard_normal(tok.vocab_size) * 2).astype(np.float32)
    history = np.argsort(-x)[:6].tolist()
    page = tmp_path / "widget.html"
    page.write_text("<html><body>" + sampler_explorer_html(tok, x, history)
                    + "</body></html>", encoding="utf-8")
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(chromium), headless=True,
                                     args=["--no-sandbox"])
        try:
            tab = browser.new_page()
            errors = []
            tab.on("console", lambda m: m.type == "error" and errors.append(m.text))
            tab.on("pageerror", lambda e: errors.append(str(e)))
            tab.goto(page.as_uri())
            assert tab.get_attribute(".fucina-sampler-widget", "data-checked") == "ok"
            before = tab.inner_html(".fw-rows"), tab.inner_text(".fw-summary")
            for name, value in (("temperature", 1.8), ("repeat_penalty", 1.6),
                                ("top_k", 3)):
                move = "(e, v) => { e.value = v; e.dispatchEvent(new Event('input')); }"
                tab.eval_on_selector(f"input[name={name}]", move, value)
                after = tab.inner_html(".fw-rows"), tab.inner_text(".fw-summary")
                assert after != before, name
                before = after
            assert "kept 3 of 256" in before[1]
            assert not errors, errors
        finally:
            browser.close()
