"""Sampling: from the model's scores (logits) to one token id.

The forward pass ends with one score per vocabulary entry.  Greedy decoding takes
the largest; it is right for tests and benchmarks (a pure function of the input),
but it makes an instruction-tuned model loop.  Chat samples instead, with
llama.cpp's parameter set, in one fixed order:

    logit bias -> logit processor (optional) -> penalties
    -> [temperature <= 0: argmax, done] -> top-k (sorted, ties to the lower id)
    -> temperature softmax (max subtracted) -> top-p
    -> min-p (the best candidate always stays) -> one seeded draw

Each stage is a small function of this module working on the survivors of the
one before, so a plot or a test can stop after any of them.  The logit bias comes
first, as in llama.cpp's chain (`common_sampler` puts `logit_bias` before every
other sampler): a bias says what the caller wants of a token whatever the model
thinks, so a grammar's mask and the penalties see the biased scores, and a
banned token (bias -100) cannot come back through them.

Order.  This is the order of the Zig engine this course follows, and the one in
which top-p and min-p read the very probabilities the draw will use.  llama.cpp's
default chain (`common_sampler`) applies temperature *last*, after top-p and
min-p: there top-p = 0.95 keeps the nucleus of the untempered distribution,
whatever the temperature.  The two chains agree when the temperature is 1 or
top-p and min-p are off; chapter 8 shows what changes otherwise.  Each stage on
its own equals llama.cpp's sampler of the same name (tests/test_sampler.py drives
the `llama_sampler_*` C API on the same candidates).

Randomness.  Exactly one draw per `Sampler.next`, in every mode (greedy too,
where it is discarded): the n-th sampled token always used the n-th number of the
seed's stream, so nothing (a new temperature, a retried turn) shifts later draws.
The stream is llama.cpp's own, `std::mt19937(seed)` read through
`std::uniform_real_distribution<double>` as libstdc++ computes it: the same seed
over the same candidates picks the same token as llama.cpp's `dist` sampler (a
libc++ or MSVC build of llama.cpp rounds that double differently).
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass, replace
from typing import Callable, NamedTuple, Sequence

import numpy as np

from .errors import FucinaError

LogitProcessor = Callable[[np.ndarray, Sequence[int]], np.ndarray]


class InvalidSamplerConfig(FucinaError, ValueError):
    """A sampling parameter outside its meaningful range (NaN, top_p = 0, ...)."""


@dataclass(frozen=True)
class SamplerConfig:
    """The knobs, with llama.cpp's defaults (`llama-cli`, `create_completion`).

    temperature <= 0 is greedy (argmax).  top_k = 0 disables top-k, but the
    candidates are still the `max_candidates` best (the Zig engine's window),
    renormalized among themselves: top_k = 0 then behaves as llama.cpp's top_k =
    256, not its top_k = 0 (which keeps every token).  The window is for speed:
    one `argpartition` pass over Qwen's 151,936 scores finds it in a small fraction
    of the time that sorting the whole vocabulary takes (measured:
    docs/BENCHMARKS.md#candidate-window).  What it drops grows with the
    temperature: on chapter 8's first prediction, 0.4% of the mass at T = 0.7, 7%
    at T = 1, 45% at T = 1.5.
    `max_candidates = 0` takes the whole vocabulary, exactly llama.cpp's top_k = 0;
    any top_k in 1..256 never meets the window.

    Penalties (llama.cpp's `penalties` sampler, one step, `apply_penalties`): over
    the last `repeat_last_n` tokens of the history, each distinct token with count
    c gets l / repeat_penalty (l * repeat_penalty if l <= 0), minus
    c * frequency_penalty + presence_penalty.  repeat_last_n = -1 penalizes the
    whole history, 0 turns the penalties off.  seed = None draws a fresh seed
    (llama.cpp's LLAMA_DEFAULT_SEED); the `Sampler` records the seed it used.

    logit_bias (llama.cpp's `logit_bias` sampler, OpenAI's `logit_bias`): pairs
    (token id, bias), each bias added to that token's logit before anything else
    (a mapping {id: bias} is accepted and stored as pairs sorted by id: the config
    stays frozen and hashable).  Biases are finite; OpenAI's range [-100, 100] is
    the server's rule, not the sampler's (-100 bans a token in practice: logits
    are tens at most).  An id outside the vocabulary is an error when sampling,
    where the vocabulary is known.
    """

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repeat_last_n: int = 64
    seed: int | None = None
    max_candidates: int = 256
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self):
        def bad(name, why):
            raise InvalidSamplerConfig(f"{name} {why}, got {getattr(self, name)!r}")

        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))

        for name in ("temperature", "top_p", "min_p", "repeat_penalty",
                     "frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                bad(name, "must be a number")
            if not math.isfinite(value):
                bad(name, "must be a finite number")
        for name in ("top_k", "repeat_last_n", "max_candidates"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                bad(name, "must be an integer")
        if self.top_k < 0:
            bad("top_k", "must be >= 0 (0 turns it off)")
        if not 0 < self.top_p <= 1:
            bad("top_p", "must be in (0, 1] (1 turns it off)")
        if not 0 <= self.min_p <= 1:
            bad("min_p", "must be in [0, 1] (0 turns it off)")
        if self.repeat_penalty <= 0:
            bad("repeat_penalty", "must be > 0 (1 turns it off)")
        if self.repeat_last_n < -1:
            bad("repeat_last_n", "must be >= -1 (-1: whole history, 0: off)")
        if self.max_candidates < 0:
            bad("max_candidates", "must be >= 0 (0: the whole vocabulary)")
        seed = self.seed
        if seed is not None and (isinstance(seed, bool)
                                 or not isinstance(seed, (int, np.integer))
                                 or not 0 <= seed < 2**32):
            bad("seed", "must be an integer in 0 .. 2**32-1, or None for a random one")

    @property
    def is_greedy(self) -> bool:
        return self.temperature <= 0

    @property
    def penalties_active(self) -> bool:
        return self.repeat_last_n != 0 and (
            self.repeat_penalty != 1 or self.frequency_penalty != 0
            or self.presence_penalty != 0)

    @classmethod
    def greedy(cls, **overrides) -> "SamplerConfig":
        """Argmax decoding (after the penalties, if any are set)."""
        return cls(**{"temperature": 0.0, **overrides})

    @classmethod
    def qwen3(cls, *, thinking: bool = True, **overrides) -> "SamplerConfig":
        """The Qwen3 model card's settings: temperature 0.6, top-k 20, top-p 0.95
        when the model thinks; 0.7 / 20 / 0.8 when it does not; min-p 0.  The card
        adds a presence penalty in [0, 2] against endless repetition (higher values
        may mix languages): pass it as an override, `qwen3(presence_penalty=1.5)`."""
        if thinking:
            base = dict(temperature=0.6, top_k=20, top_p=0.95, min_p=0.0)
        else:
            base = dict(temperature=0.7, top_k=20, top_p=0.8, min_p=0.0)
        return cls(**{**base, **overrides})

    def with_(self, **changes) -> "SamplerConfig":
        return replace(self, **changes)


def _bias_pairs(bias) -> tuple[tuple[int, float], ...]:
    """A logit bias as given (a mapping or (id, bias) pairs) -> pairs sorted by id,
    each id an integer >= 0 once, each bias a finite number."""
    def bad(why):
        raise InvalidSamplerConfig(f"logit_bias {why}")

    items = bias.items() if hasattr(bias, "items") else bias
    try:
        pairs = [(tid, value) for tid, value in items]
    except (TypeError, ValueError):
        bad(f"must be a mapping or (id, bias) pairs, got {bias!r:.60}")
    out = {}
    for tid, value in pairs:
        if isinstance(tid, bool) or not isinstance(tid, (int, np.integer)) or tid < 0:
            bad(f"token ids must be integers >= 0, got {tid!r:.30}")
        if (isinstance(value, bool) or not isinstance(value, (int, float, np.floating))
                or not math.isfinite(value)):
            bad(f"biases must be finite numbers, got {value!r:.30} for token {tid}")
        if int(tid) in out:
            bad(f"names token {int(tid)} twice")
        out[int(tid)] = float(value)
    return tuple(sorted(out.items()))


class Distribution(NamedTuple):
    """What the next draw chooses from: candidate ids, most likely first, and their
    probabilities (float64, renormalized over the survivors: they sum to 1)."""

    ids: np.ndarray
    probs: np.ndarray


# --- the stages -------------------------------------------------------------------

def apply_penalties(logits: np.ndarray, history: Sequence[int],
                    config: SamplerConfig) -> np.ndarray:
    """llama.cpp's repetition penalties, on a copy (the caller's array is untouched).

    Once per *distinct* token among the last `repeat_last_n` of the history: a
    positive logit is divided by repeat_penalty, a negative one multiplied
    (dividing a negative score would make the token *more* likely); then
    count * frequency_penalty + presence_penalty is subtracted.  float32, in
    llama.cpp's order of operations, so the results are bit-identical.
    """
    if not config.penalties_active or len(history) == 0:
        return logits
    n = config.repeat_last_n
    window = np.asarray(history[-n:] if n > 0 else history, dtype=np.int64)
    ids, counts = np.unique(window, return_counts=True)
    if ids[0] < 0 or ids[-1] >= logits.shape[0]:
        bad = ids[0] if ids[0] < 0 else ids[-1]
        raise FucinaError(f"history token id {int(bad)} is outside the vocabulary "
                          f"(size {logits.shape[0]})")
    out = logits.copy()
    x = out[ids]
    rp = np.float32(config.repeat_penalty)
    x = np.where(x <= 0, x * rp, x / rp)
    x -= (counts.astype(np.float32) * np.float32(config.frequency_penalty)
          + np.float32(config.presence_penalty))
    out[ids] = x
    return out


def apply_logit_bias(logits: np.ndarray, ids, biases) -> np.ndarray:
    """llama.cpp's `logit_bias` sampler, on a copy: `biases[i]` added to the logit
    of token `ids[i]`, in float32 (as llama.cpp adds a float), so the results are
    bit-identical.  An id outside the vocabulary is an error, not a silent skip:
    the caller asked for something about a token that does not exist."""
    ids = np.asarray(ids, dtype=np.int64)
    if ids.size == 0:
        return logits
    if ids.min() < 0 or ids.max() >= logits.shape[0]:
        bad = ids.min() if ids.min() < 0 else ids.max()
        raise FucinaError(f"logit_bias token id {int(bad)} is outside the vocabulary "
                          f"(size {logits.shape[0]})")
    out = logits.copy()
    np.add.at(out, ids, np.asarray(biases, dtype=np.float32))  # repeated ids add up
    return out


def top_k(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The k largest logits as (ids, values), sorted descending, ties by lower id.

    `argpartition` finds the k best in one pass over the vocabulary and only they
    are sorted.  The tie rule can only matter when the k-th value also occurs
    outside the k found, so that is checked, not paid for on every call."""
    n = logits.shape[0]
    k = min(int(k), n)
    if k < n:
        ids = np.argpartition(logits, n - k)[n - k:]
        kth = logits[ids].min()
        if np.count_nonzero(logits == kth) != np.count_nonzero(logits[ids] == kth):
            above = np.flatnonzero(logits > kth)
            ties = np.flatnonzero(logits == kth)[: k - above.size]  # lower ids first
            ids = np.concatenate([above, ties])
    else:
        ids = np.arange(n)
    ids = ids[np.lexsort((ids, -logits[ids]))]          # value descending, then id
    return ids, logits[ids]


def softmax(scaled: np.ndarray) -> np.ndarray:
    """Probabilities of temperature-scaled logits that are sorted descending.

    The max (the first value) is subtracted before exp, so exp cannot overflow.
    float32, summed left to right, as llama.cpp does: float64 would be closer to
    the true values (by ~1e-6 near p = 1), but then top-p could cut one candidate
    earlier or later than llama.cpp.  (`np.cumsum` adds left to right; `np.sum` is
    pairwise and rounds differently.)"""
    e = np.exp(scaled - scaled[0])                                     # float32
    return e / np.cumsum(e)[-1]


def top_p(probs: np.ndarray, p: float) -> int:
    """How many sorted candidates nucleus sampling keeps: the shortest prefix whose
    cumulative probability reaches p (at least one; p >= 1 keeps them all).  The
    running sum is float32, left to right, like llama.cpp's."""
    if p >= 1.0:
        return probs.shape[0]
    first = int(np.searchsorted(np.cumsum(probs), np.float32(p), side="left"))
    return min(first + 1, probs.shape[0])


def min_p(scaled: np.ndarray, p: float) -> int:
    """How many sorted candidates have probability >= p * p(best) (at least one).

    Compared in logit space, as llama.cpp does: p_i >= p * p_0 exactly when
    l_i >= l_0 + log p, so no softmax is needed; float32, like llama.cpp, so the
    boundary falls in the same place."""
    if p <= 0.0:
        return scaled.shape[0]
    floor = scaled[0] + np.float32(math.log(p))
    below = np.flatnonzero(scaled < floor)
    return max(1, int(below[0])) if below.size else scaled.shape[0]


def draw(probs: np.ndarray, u: float) -> int:
    """The index that a uniform u in [0, 1) selects: the first candidate whose
    cumulative probability reaches u * total (llama.cpp's `dist` rule, float64)."""
    cum = np.cumsum(probs, dtype=np.float64)
    first = int(np.searchsorted(cum, cum[-1] * u, side="left"))
    return min(first, probs.shape[0] - 1)


class Mt19937Uniform:
    """Uniform doubles in [0, 1), exactly as llama.cpp's `dist` sampler draws them.

    `std::mt19937(seed)` starts from the state of numpy's legacy
    `RandomState(seed)` (both use `init_genrand`); libstdc++'s
    `generate_canonical<double>` combines two 32-bit outputs a, b as
    (a + b * 2^32) / 2^64.  Checked against a compiled C++ program, and against
    llama.cpp's sampler in tests/test_sampler.py."""

    def __init__(self, seed: int):
        _, key, pos, *_ = np.random.RandomState(seed).get_state()
        self._bits = np.random.MT19937(0)
        self._bits.state = {"bit_generator": "MT19937",
                            "state": {"key": key, "pos": pos}}

    def __call__(self) -> float:
        a, b = self._bits.random_raw(2)
        u = (float(a) + float(b) * 4294967296.0) / 18446744073709551616.0
        return u if u < 1.0 else math.nextafter(1.0, 0.0)


class Sampler:
    """A `SamplerConfig` and its random stream; `next(logits, history)` picks a token.

    `history` is every token id already in the sequence (prompt and answer), most
    recent last; the penalties read its tail.  A `logit_processor(logits,
    history)` (the seam for constrained decoding) gets a private copy of the
    logits and returns the ones to use.
    """

    def __init__(self, config: SamplerConfig | None = None, *,
                 logit_processor: LogitProcessor | None = None):
        self.config = config if config is not None else SamplerConfig()
        self.logit_processor = logit_processor
        bias = self.config.logit_bias          # as arrays once, not once per token
        self._bias_ids = np.array([t for t, _ in bias], dtype=np.int64)
        self._bias_values = np.array([b for _, b in bias], dtype=np.float32)
        self.seed = self.config.seed
        if self.seed is None:
            self.seed = secrets.randbits(32)
        self.reset()

    def reset(self) -> None:
        """Back to the start of the seed's stream."""
        self._uniform = Mt19937Uniform(self.seed)
        self.draws = 0

    def distribution(self, logits, history: Sequence[int] = ()) -> Distribution:
        """The candidates and probabilities the next draw would use (no draw)."""
        cfg = self.config
        x = self._checked(logits)
        if self._bias_ids.size:
            x = self._checked(apply_logit_bias(x, self._bias_ids, self._bias_values),
                              "logits after logit_bias")
        if self.logit_processor is not None:
            x = self._checked(self.logit_processor(x.copy(), history),
                              "logit processor output")
        x = apply_penalties(x, history, cfg)
        if cfg.is_greedy:
            return Distribution(np.array([int(np.argmax(x))]), np.ones(1))
        ids, values = top_k(x, cfg.top_k or cfg.max_candidates or x.shape[0])
        scaled = values / np.float32(cfg.temperature)                  # [k] float32
        probs = softmax(scaled)
        n = top_p(probs, cfg.top_p)
        n = min_p(scaled[:n], cfg.min_p)
        kept = probs[:n].astype(np.float64)
        return Distribution(ids[:n], kept / kept.sum())

    def next(self, logits, history: Sequence[int] = ()) -> int:
        """Sample one token id: the whole pipeline, then exactly one draw."""
        return self.pick(self.distribution(logits, history))

    def pick(self, dist: Distribution) -> int:
        """One draw from a distribution (`distribution`'s result)."""
        u = self.uniform()
        return int(dist.ids[draw(dist.probs, u)]) if dist.ids.shape[0] > 1 \
            else int(dist.ids[0])

    def uniform(self) -> float:
        """The stream's next number in [0, 1) (counted in `draws`)."""
        self.draws += 1
        return self._uniform()

    @staticmethod
    def _checked(logits, what: str = "logits") -> np.ndarray:
        x = np.asarray(logits, dtype=np.float32)
        if x.ndim != 1 or x.shape[0] == 0:
            raise FucinaError(f"{what}: expected one non-empty row of scores, "
                              f"got shape {list(x.shape)}")
        top = x.max()              # one pass: NaN propagates to the max, so does +inf
        if not np.isfinite(top):
            why = ("NaN among the scores" if np.isnan(top) else
                   "+inf among the scores" if top > 0 else "every score is -inf")
            raise FucinaError(f"{what}: {why}; refusing to sample from them")
        return x
