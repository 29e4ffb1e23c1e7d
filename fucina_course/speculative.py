"""Speculative decoding: guess several tokens cheaply, check them all in one step.

Decode is memory-bound (chapter 07): a step reads every weight once whether it
carries one token or eight, so checking eight guessed tokens costs little more
than making one.  Speculation exploits it:

1. a *drafter* guesses the next k tokens (`Draft`);
2. the model runs the chosen token and the k guesses in one multi-row step
   (`Model.forward_step_all_logits`): row i holds the logits that follow guess i;
3. walking the rows, the sampler picks each next token as it always would; while
   its pick equals the guess, the guess is accepted and the next row is already
   computed; the first disagreement is itself a token (the model's own pick), and
   the cache forgets the guesses after it (generation.py: `Sequence.verify` /
   `accept`, and `Decoder.speculate`, the one verify/accept loop).

Every step emits at least one token, so a drafter that always guesses wrong costs
only the extra rows of each step; one that guesses right emits up to k + 1.

Exactness.  The verify step runs with `per_row=True`: each row's attention is the
decode kernel's, row by row, and the multi-row matmul kernels equal matvec bit for
bit (quant/matmul.py), so row i's logits are *bit-identical* to those of a plain
decode step at that position (tests/test_speculative.py).  Without it the batched
attention (BLAS, another summation order) moved the default model's logits by up
to 0.3 after 24 layers, enough to flip a near-tie: greedy speculation would not
reproduce greedy decoding.  The per-row attention costs nothing measurable at k <= 8.

Sampling, and what a seed means.  The standard rule (Leviathan et al. 2023, Chen
et al. 2023): with target distribution p and draft distribution q, accept the guess
d with probability min(1, p(d) / q(d)); on rejection draw from the residual
max(0, p - q), renormalised.  The emitted tokens are then distributed exactly as
plain sampling's, whatever q is (`accept_sampled`; the chi-square test in
tests/test_speculative.py).  Prompt lookup and greedy draft models guess
*deterministically*: q is a point mass on d, so min(1, p(d)/q(d)) = p(d), and the
residual is p without d, renormalised.  Drawing x from p with the sampler's usual
single draw and accepting iff x == d realises exactly that rule (x == d has
probability p(d); given x != d, x follows p restricted to the other tokens), and it
spends one draw per emitted token in the same order as plain decoding.  So with a
deterministic drafter a seed gives *the same tokens* as without speculation (greedy
or sampled), only sooner.  Sampled drafts (`DraftModel(sample=True)`) use the
general rule, which spends one extra draw per judged guess: the seed still fixes
the output for a given drafter and draft length, but it is another stream than
plain sampling's, with the same distribution.

Drafters:
* `PromptLookup` (Saxena 2023; llama.cpp's `lookup`, transformers'
  `prompt_lookup_num_tokens`): find the last few tokens earlier in the text
  (prompt and answer so far) and guess what followed them there.  No second model,
  no cost worth measuring (~0.1 ms on 4K tokens, numpy); strong exactly where small
  local models are used -- editing code, quoting, summarising -- and silent on free
  prose, where it finds no match and the step is a plain decode step.
* `DraftModel`: a smaller model with the same vocabulary (Qwen3-0.6B drafting for
  Qwen3-8B; Qwen2.5-0.5B for Qwen2.5-7B) decodes k tokens ahead with its own cache.
  It pays k small decode steps per verify step, so it only helps when the target is
  several times slower than the draft.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence

import numpy as np

from .errors import FucinaError
from .kv_cache import common_prefix
from .sampler import Distribution, Sampler, SamplerConfig, draw

# 7 guesses + the chosen token = 8 rows: one tile of the multi-row kernels
# (quant/_ir.py TILE), which unpack each weight block once per tile.  A ninth row
# starts a second tile, which made a verify step 1.3 to 1.5 times as long, and a
# code edit decoded faster with 7 guesses per step than with 8 (measured:
# docs/BENCHMARKS.md#draft-max).
DEFAULT_DRAFT_MAX = 7


@dataclass
class Draft:
    """Guessed continuation: `ids`, and for sampled drafts the distribution each
    was drawn from (`q[i]` for `ids[i]`); `q` None means deterministic guesses."""

    ids: list[int]
    q: list[Distribution] | None = None


class Drafter(Protocol):
    """Anything that guesses: `propose(tokens, limit)` -> at most `limit` ids that
    might follow `tokens` (the whole sequence so far, prompt included)."""

    name: str

    def propose(self, tokens: Sequence[int], limit: int) -> Draft: ...


class PromptLookup:
    """Guess by copying: the most recent earlier occurrence of the sequence's last
    n tokens (n from `ngram_max` down to `ngram_min`), and the tokens after it.

    Longer n-grams first: a 3-token match is rarely an accident, a 1-token match
    usually is.  `ngram_min` = 3 by default: on free prose a repeated token or pair
    (" the", ", and") matched often and its guesses were mostly wrong, each one a row
    of wasted verify work.  Replayed on the default model's greedy answers to the
    held-in prompts of bench/bench_speculative.py (64 tokens, measured step costs):
    ngram_min 2 -> 3 took a story from 0.93x to 1.01x and left the code edits at
    2.4-2.7x.  The most recent occurrence wins over the first one: in an answer
    that rewrites its prompt, the nearest copy is the one being followed.
    """

    def __init__(self, ngram_max: int = 3, ngram_min: int = 3):
        if not 1 <= ngram_min <= ngram_max:
            raise FucinaError(f"prompt lookup needs 1 <= ngram_min <= ngram_max, got "
                              f"{ngram_min}, {ngram_max}")
        self.ngram_max, self.ngram_min = int(ngram_max), int(ngram_min)
        self.name = "lookup"

    def propose(self, tokens: Sequence[int], limit: int) -> Draft:
        arr = np.asarray(tokens, dtype=np.int64)
        n_tok = arr.shape[0]
        for n in range(min(self.ngram_max, n_tok - 1), self.ngram_min - 1, -1):
            tail = arr[n_tok - n:]
            # starts j < n_tok - n where arr[j:j+n] == tail (the tail itself excluded)
            hits = np.ones(n_tok - n, dtype=bool)
            for i in range(n):
                hits &= arr[i:n_tok - n + i] == tail[i]
            starts = np.flatnonzero(hits)
            if starts.size:
                after = int(starts[-1]) + n                  # the most recent match
                return Draft(arr[after:after + limit].tolist())
        return Draft([])


class DraftModel:
    """Guess with a smaller model of the same vocabulary, decoding ahead in its own
    KV cache.

    The cache follows the target's sequence: each `propose` keeps the longest common
    prefix of what it holds and the tokens given, prefills the rest, then decodes
    `limit` tokens (the last guess is never fed back: `limit` small steps, not
    `limit` + 1).  `sample=False` (default) drafts greedily -- a deterministic
    guess, so the output equals plain decoding's for any seed; `sample=True` draws
    each guess from the draft's own distribution under `config` (the target's
    sampler settings) and a stream seeded by `seed`, for the general rule.
    """

    def __init__(self, model, target_vocab_size: int | None = None, *,
                 sample: bool = False, config: SamplerConfig | None = None,
                 seed: int | None = None, capacity: int | None = None,
                 cache_type: str = "f16"):
        self.model = model
        if target_vocab_size is not None:
            check_same_vocabulary(model, target_vocab_size)
        self.sample = bool(sample)
        self.sampler = Sampler((config or SamplerConfig()).with_(seed=seed))
        self.cache = model.new_cache(capacity, cache_type)
        self.tokens: list[int] = []
        self.name = f"draft:{model.path.name}"

    def propose(self, tokens: Sequence[int], limit: int) -> Draft:
        tokens = list(tokens)
        limit = min(limit, self.cache.capacity - len(tokens))
        if limit < 1:
            return Draft([])
        # at least one token to run, for its logits
        keep = min(common_prefix(self.tokens, tokens), len(tokens) - 1)
        self.cache.truncate(keep)
        del self.tokens[keep:]
        logits = self.model.forward_step(tokens[keep:], keep, self.cache)
        self.tokens.extend(tokens[keep:])
        ids, qs = [], []
        for i in range(limit):
            if self.sample and not self.sampler.config.is_greedy:
                q = self.sampler.distribution(logits, self.tokens)
                tid = self.sampler.pick(q)
                qs.append(q)
            else:
                tid = int(np.argmax(logits))
            ids.append(tid)
            if i + 1 < limit:
                logits = self.model.forward_step([tid], len(self.tokens), self.cache)
                self.tokens.append(tid)
        return Draft(ids, qs if qs else None)


def check_same_vocabulary(draft_model, target_vocab_size: int) -> None:
    """A draft model's ids must mean the target's tokens: same vocabulary size (the
    caller compares the token strings when it has both tokenizers)."""
    if draft_model.config.vocab_size != target_vocab_size:
        raise FucinaError(
            f"draft model {draft_model.path.name} has a vocabulary of "
            f"{draft_model.config.vocab_size} ids, the target {target_vocab_size}: "
            "a draft must share the target's tokenizer")


def same_tokens(a, b) -> bool:
    """Do two tokenizers spell every id the same way (a draft's ids are the
    target's)?"""
    return (a is not None and b is not None and len(a.token_bytes) == len(b.token_bytes)
            and all(x == y for x, y in zip(a.token_bytes, b.token_bytes)))


def accept_sampled(p: Distribution, q: Distribution, guess: int, u_accept: float,
                   u_residual) -> tuple[int, bool]:
    """The speculative-sampling rule for one guess drawn from q: (token, accepted).

    Accept with probability min(1, p(guess) / q(guess)) (u_accept uniform in [0, 1));
    otherwise draw from max(0, p - q) renormalised, with `u_residual()` (called only
    then).  The token is distributed exactly as p."""
    p_g = _prob(p, guess)
    q_g = _prob(q, guess)
    if q_g > 0.0 and u_accept * q_g < p_g:
        return guess, True
    ids = np.union1d(p.ids, q.ids)
    residual = np.maximum(_probs_at(p, ids) - _probs_at(q, ids), 0.0)
    if residual.sum() <= 0.0:             # p == q on q's support: never reached
        residual = _probs_at(p, ids)
    return int(ids[draw(residual, u_residual())]), False


def judge(sampler: Sampler, logits, history: Sequence[int], guess: int,
          q: Distribution | None) -> int:
    """The sampler's next token at a position where the drafter guessed `guess`.

    A deterministic guess (q None), or a greedy sampler: exactly `sampler.next` --
    the guess is accepted iff the ordinary draw equals it (module docstring).  A
    sampled guess: `accept_sampled`, with the sampler's own stream."""
    if q is None or sampler.config.is_greedy:
        return sampler.next(logits, history)
    p = sampler.distribution(logits, history)
    return accept_sampled(p, q, guess, sampler.uniform(), sampler.uniform)[0]


def _prob(d: Distribution, tid: int) -> float:
    hit = np.flatnonzero(d.ids == tid)
    return float(d.probs[hit[0]]) if hit.size else 0.0


def _probs_at(d: Distribution, ids: np.ndarray) -> np.ndarray:
    order = np.argsort(d.ids)
    pos = np.searchsorted(d.ids[order], ids)
    pos = np.minimum(pos, len(order) - 1)
    found = d.ids[order][pos] == ids
    return np.where(found, d.probs[order][pos], 0.0)


@dataclass
class SpeculationStats:
    """What speculation did over one or more answers."""

    steps: int = 0            # verify steps (each emitted >= 1 token)
    drafted: int = 0          # guesses checked
    accepted: int = 0         # guesses the model agreed with
    per_step: list[int] = field(default_factory=list)   # accepted guesses per step

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    def record(self, drafted: int, accepted: int) -> None:
        self.steps += 1
        self.drafted += drafted
        self.accepted += accepted
        self.per_step.append(accepted)

    def line(self) -> str:
        return (f"speculation: {self.drafted} drafted, {self.accepted} accepted "
                f"({100 * self.acceptance:.0f}%), {self.steps} verify steps")


class Speculator:
    """A drafter and its budget: at most `draft_max` guesses per step, never past
    the cache or the answer's token limit (the caller's `room`)."""

    def __init__(self, drafter: Drafter, draft_max: int = DEFAULT_DRAFT_MAX):
        if draft_max < 1:
            raise FucinaError(f"the draft length must be at least 1, got {draft_max}")
        self.drafter, self.draft_max = drafter, int(draft_max)
        self.stats = SpeculationStats()

    @property
    def name(self) -> str:
        return self.drafter.name

    def propose(self, tokens: Sequence[int], room: int) -> Draft:
        limit = min(self.draft_max, room)
        if limit < 1:
            return Draft([])
        draft = self.drafter.propose(tokens, limit)
        draft.ids = [int(t) for t in draft.ids[:limit]]
        return draft


def verify_step(model, ids: Sequence[int], cache) -> np.ndarray:
    """Run `ids` after the cache: logits `[len(ids), vocab]`, row i bit-identical
    to a plain decode step's at that position.  One id is a plain decode step."""
    if len(ids) == 1:
        return model.forward_step(ids, cache.len, cache)[None, :]
    return model.forward_step_all_logits(ids, cache.len, cache, per_row=True)
