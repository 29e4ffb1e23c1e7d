"""The generation core: the ids in a KV cache, and the one decode loop.

Every way this engine writes text is the same loop -- `Model.generate`, a chat
`Conversation` (chat.py), a server slot (scheduler.py), with or without speculation:

    logits = seq.extend(prompt)             prefill: the ids the cache lacks
    while (tid := decoder.choose(logits)) is not None:
        logits = advance([(decoder, tid)])  one forward step; tid is committed

`Sequence` owns a cache and the ids in it; `Decoder` owns one answer in progress
over a sequence (choose, commit, speculate); `decode` drives one decoder, or several
in lockstep (one `forward_step_batch` per step reads the weights once for all).
mlx-lm's `generate_step`, which its CLI, server and speculation all drive, is the
model; llama.cpp's server slot (`n_decoded`, `has_next_token`) states the same rules.

The invariant, kept by `Sequence` alone: the ids it lists are exactly the ids in its
cache, and `text` (when known) is what they spell.  Only its methods change the
three, and a forward step is all or nothing (model.py `_forward`), so an error or a
Ctrl-C anywhere leaves a sequence that can go on.

When an answer ends.  `choose` samples a token, then decides: an end-of-turn id
("end"), no free position to feed it ("context_full"), a stop string completed
("stop_string", the caller's `on_token` says), or the answer's `limit` reached
("max_tokens").  The loop never feeds the token that ends an answer: its logits
would be thrown away (llama.cpp's server stops a slot the same way).  It is kept
in `final`; a "max_tokens" one is part of the answer (`answer`), the others are
what stopped it.  A chat turn feeds a last token cut by the limit when it closes
(`feed_final`), so that its next turn starts after the ids the model wrote, not
after a re-encoding of their text.

Log-probabilities (`Decoder(logprobs=k)`, the server's `logprobs`).  For each token
it chooses, the decoder records `TokenLogprob`: the token's log-probability under
the distribution the model produced -- the log-softmax, in float64, of the raw
logits `choose` was given, before the logit bias, the penalties, a grammar's mask,
the temperature and the filters (as OpenAI and llama.cpp's server report it) --
and the k most likely ids by that same distribution.  Nothing is computed unless
asked.  The record holds the tokens of the answer (`answer`) and the token that
completed a stop string (its text before the stop may be shown); an end id or a
token that found the cache full is not recorded.  Speculation records too: every
token goes through `choose`, with the logits of its own row of the verify step,
which equal a plain decode step's (`Sequence.verify`).
"""

from __future__ import annotations

from typing import Callable, Iterable, NamedTuple, Sequence as Ids

import numpy as np

from .errors import FucinaError
from .sampler import SamplerConfig
from .speculative import judge, verify_step


class TokenLogprob(NamedTuple):
    """A chosen token `id`, its `logprob` under the model's distribution, and
    `top`: the most likely ids with theirs, [(id, logprob)], best first (ties: the
    lower id first, as the argmax)."""

    id: int
    logprob: float
    top: list


def token_logprobs(logits, tid: int, k: int) -> TokenLogprob:
    """`tid`'s log-softmax over the whole vocabulary (float64: a log-probability
    near 0 keeps its digits), and the `k` best."""
    x = np.asarray(logits, dtype=np.float64)                         # [vocab]
    top = x.max()
    lse = top + np.log(np.exp(x - top).sum())
    best = []
    if k > 0:
        k = min(k, x.shape[0])
        ids = np.argpartition(-x, k - 1)[:k]                         # [k], unordered
        ids = ids[np.lexsort((ids, -x[ids]))]                        # best first
        best = [(int(i), float(x[i] - lse)) for i in ids]
    return TokenLogprob(int(tid), float(x[tid] - lse), best)


class Piece(str):
    """A piece of an answer's text as it streams, carrying `logprobs`: the
    `TokenLogprob`s recorded since the previous piece (None: none are recorded).
    A str, so a writer that only wants the text takes it as it is."""

    def __new__(cls, text: str, logprobs: list | None = None):
        piece = super().__new__(cls, text)
        piece.logprobs = logprobs
        return piece


class Sequence:
    """A KV cache and the ids in it: prefill, rewind, batched steps, and the
    verify / accept pair of speculation.  `text`: what the ids spell, or None
    while that is not known (a chat turn in progress, a rewind)."""

    def __init__(self, model, cache):
        self.model, self.cache = model, cache
        self._ids: list[int] = []        # exactly the ids in the cache
        self._pending: list[int] = []    # guesses verified past them (`verify`)
        self.text: str | None = ""

    @property
    def tokens(self) -> list[int]:
        """The ids in the KV cache, in order (a copy)."""
        return list(self._ids)

    def __len__(self) -> int:
        return len(self._ids)

    @property
    def remaining(self) -> int:
        """Free positions in the KV cache."""
        return self.cache.remaining

    def reset(self) -> None:
        self.cache.truncate(0)
        self._ids, self._pending, self.text = [], [], ""

    def rewind(self, n_tokens: int) -> None:
        """Keep only the first `n_tokens` ids (`KvCache.truncate`); the text they
        spell is unknown until the next `extend` says."""
        self._pending = []
        if n_tokens < len(self._ids):
            self.cache.truncate(n_tokens)
            del self._ids[n_tokens:]
            self.text = None

    def copy_from(self, other: "Sequence", n_tokens: int) -> None:
        """Hold the first `n_tokens` ids of `other` (a sequence of the same model),
        their K and V copied rather than computed (`KvCache.copy_from`): the
        choices of one prompt prefill it once.  All or nothing: until the copy is
        complete this sequence holds no ids."""
        ids = other._ids[:n_tokens]
        self.reset()
        self.text = None
        self.cache.copy_from(other.cache, len(ids))
        self._ids = ids

    def extend(self, ids: Ids[int], text: str | None = None):
        """Run `ids` through the model after the ids in the cache (a prefill, or a
        chunk of one); the cache then holds both, and they spell `text` (None: not
        known).  The last row's logits."""
        self._pending = []
        logits = self.model.forward_step(ids, len(self._ids), self.cache)
        self._ids.extend(ids)
        self.text = text
        return logits

    def verify(self, ids: Ids[int]):
        """Speculation's step: run `ids` (a chosen token, then guesses) after the
        cache; logits `[len(ids), vocab]`, row i bit-identical to a plain decode
        step's (speculative.verify_step).  Only ids[0] is committed; the guesses
        wait in the cache, past its length, until `accept` takes them in order (the
        next verify, extend, step or rewind forgets the rest)."""
        base = len(self._ids)
        try:
            rows = verify_step(self.model, ids, self.cache)
        except BaseException:         # Ctrl-C mid-step: the cache keeps what we list
            self.cache.truncate(base)
            raise
        self.cache.truncate(base + 1)
        self._ids.append(ids[0])
        self.text = None
        self._pending = list(ids[1:])
        return rows

    def accept(self, tid: int) -> None:
        """Commit the next pending guess (it must be `tid`): its K and V are already
        in the cache (`KvCache.advance`)."""
        if not self._pending or self._pending[0] != tid:
            raise FucinaError(f"token {tid} is not the next verified guess")
        del self._pending[0]
        self.cache.advance(1)
        self._ids.append(tid)

    @staticmethod
    def step(sequences: Ids["Sequence"], ids: Ids[int]) -> list:
        """One more token for each sequence (`ids[i]` for the i-th) in one forward
        step, so the weights are read once for all of them; the logits of each."""
        model, caches = sequences[0].model, [s.cache for s in sequences]
        if len(caches) == 1:     # one stream: the plain decode step
            out = [model.forward_step(list(ids), caches[0].len, caches[0])]
        else:                    # N streams: the weights are read once
            out = model.forward_step_batch(list(ids), caches)
        for seq, tid in zip(sequences, ids):
            seq._pending = []
            seq._ids.append(tid)
            seq.text = None
        return out


class Greedy:
    """The argmax, with a sampler's interface: `Model.generate`'s choice (no copy
    of the logits, no random stream)."""

    config = SamplerConfig.greedy()

    @staticmethod
    def next(logits, history: Ids[int] = ()) -> int:
        return int(np.argmax(logits))


class Decoder:
    """One answer in progress over a `Sequence`: the sampler's choices, the stop
    rules (module docstring), and the ids committed so far (`ids`, all in the
    cache).  `on_token(tid)` sees every token that is part of the answer as it is
    chosen and returns True when the text now ends with a stop string.
    `keep_final`: the caller keeps the whole answer in the cache (a chat turn:
    `feed_final`), so speculation also verifies the token that reaches the limit,
    and keeps it when the guess was right.  `logprobs` (k >= 0): record each
    chosen token's `TokenLogprob` with the k best alternatives in `logprobs`
    (module docstring); None (default): record nothing, compute nothing."""

    def __init__(self, seq: Sequence, sampler, *, stop_ids: Iterable[int] = (),
                 limit: int | None = None,
                 on_token: Callable[[int], bool | None] | None = None,
                 keep_final: bool = False, logprobs: int | None = None):
        if limit is not None and limit < 1:
            raise FucinaError(f"an answer's token limit must be at least 1, got {limit}")
        if logprobs is not None and logprobs < 0:
            raise FucinaError(f"logprobs must be at least 0, got {logprobs}")
        self.seq, self.sampler = seq, sampler
        self.stop_ids, self.limit = frozenset(stop_ids), limit
        self.on_token, self.keep_final = on_token, keep_final
        self.ids: list[int] = []
        self.final: int | None = None    # the token that ended the answer, not fed
        self.reason: str | None = None
        self.drafted = self.accepted = 0
        self.top_logprobs = logprobs
        self.logprobs: list[TokenLogprob] | None = [] if logprobs is not None else None
        self._given = 0                  # entries handed out by `new_logprobs`

    def new_logprobs(self) -> list | None:
        """The entries recorded since the previous call (a streamed piece's)."""
        if self.logprobs is None:
            return None
        out, self._given = self.logprobs[self._given:], len(self.logprobs)
        return out

    @property
    def answer(self) -> list[int]:
        """The answer's ids: those committed, and a last one the limit cut."""
        if self.reason == "max_tokens" and self.final is not None:
            return self.ids + [self.final]
        return list(self.ids)

    def feed_final(self) -> None:
        """Feed a last token cut by the limit after all (one decode step), so the
        cache holds the whole answer."""
        if self.reason == "max_tokens" and self.final is not None:
            advance([(self, self.final)])
            self.final = None

    def choose(self, logits, guess: int | None = None, q=None) -> int | None:
        """The next token to feed, or None when the answer is over (`reason` says
        why).  `guess` (and its draft distribution `q`): a drafter's guess for this
        position, judged by the speculative rule (speculative.judge)."""
        if guess is None:
            tid = self.sampler.next(logits, self.seq._ids)
        else:
            tid = judge(self.sampler, logits, self.seq._ids, guess, q)
        if self.logprobs is not None:
            self.logprobs.append(token_logprobs(logits, tid, self.top_logprobs))
        if tid in self.stop_ids:
            return self._end("end", tid)
        if self.seq.remaining < 1:
            return self._end("context_full", tid)
        if self.on_token is not None and self.on_token(tid):
            return self._end("stop_string", tid)
        if self.limit is not None and len(self.ids) + 1 >= self.limit:
            return self._end("max_tokens", tid)
        return tid

    def _end(self, reason: str, tid: int) -> None:
        self.reason, self.final = reason, tid
        if reason in ("end", "context_full") and self.logprobs:
            self.logprobs.pop()          # not part of the answer (never shown)
        return None

    def commit(self, tid: int) -> None:
        """`tid` went through the model (`advance`): part of the answer."""
        self.ids.append(tid)

    def speculate(self, tid: int, speculator) -> int | None:
        """Feed the chosen `tid` together with the drafter's guesses in one step;
        commit `tid` and every guess the sampler agrees with; the next chosen token
        (not yet fed), or None when the answer is over.

        Every accepted guess goes through `choose`, so the end id, stop string,
        context and limit rules hold as they do without speculation.  The guesses
        never run past the cache, nor past the token that reaches the limit (with
        `keep_final`: up to it, since it will be fed)."""
        room = self.seq.remaining - 1
        if self.limit is not None:
            room = min(room, self.limit - len(self.ids) - (1 if self.keep_final else 2))
        draft = speculator.propose(self.seq._ids + [tid], room)
        rows = self.seq.verify([tid] + draft.ids)
        self.commit(tid)
        accepted, nxt = 0, None
        for i, guess in enumerate(draft.ids):
            nxt = self.choose(rows[i], guess, draft.q[i] if draft.q else None)
            # the answer's last token, guessed right: already in the cache, keep it
            last = (nxt is None and self.keep_final and self.reason == "max_tokens"
                    and self.final == guess)
            if nxt != guess and not last:
                break
            self.seq.accept(guess)
            self.commit(guess)
            accepted += 1
            if last:
                self.final = None
                break
        else:
            nxt = self.choose(rows[len(draft.ids)])
        speculator.stats.record(len(draft.ids), accepted)
        self.drafted += len(draft.ids)
        self.accepted += accepted
        return nxt


def advance(picks: Ids[tuple[Decoder, int]]) -> list:
    """One forward step for the chosen token of each decoder (one batched step for
    all), each committed; their next logits, in order."""
    out = Sequence.step([d.seq for d, _ in picks], [tid for _, tid in picks])
    for d, tid in picks:
        d.commit(tid)
    return out


def decode(decoders: Ids[Decoder], logits: Ids, speculator=None) -> None:
    """The decode loop: from each decoder's first logits (its prefill's) until
    every answer is over.  One decoder with a `speculator` drafts and verifies;
    several run in lockstep (a batch already shares each read of the weights)."""
    if speculator is not None and len(decoders) == 1:
        tid = decoders[0].choose(logits[0])
        while tid is not None:
            tid = decoders[0].speculate(tid, speculator)
        return
    running = list(zip(decoders, logits))
    while running:
        picks = [(d, d.choose(row)) for d, row in running]
        picks = [(d, tid) for d, tid in picks if tid is not None]
        if not picks:
            return
        running = list(zip([d for d, _ in picks], advance(picks)))


def generate(model, prompt_ids, max_new_tokens: int, *, stop_ids=None, cache=None,
             on_token=None, speculator=None) -> list[int]:
    """Greedy generation: prefill the prompt, then argmax one token at a time
    (with a `speculator`: the same tokens in fewer forward steps, speculative.py).

    Stops after `max_new_tokens`, at a stop id (default: the tokenizer's end-of-turn
    ids; the stop token is included in the result), or when the cache is full (the
    token that found it full is included)."""
    prompt_ids = list(prompt_ids)
    if stop_ids is None:
        stop_ids = set(model.tokenizer.eot_ids) if model.tokenizer else set()
    if cache is None:
        capacity = min(model.config.context_length, len(prompt_ids) + max_new_tokens)
        cache = model.new_cache(capacity)
    elif cache.len:
        raise FucinaError(f"generate needs an empty cache, this one holds {cache.len} "
                          "positions (a Conversation keeps its cache across turns)")
    if max_new_tokens <= 0:
        return []
    def emit(tid: int) -> None:   # no stop strings here: what on_token returns is moot
        if on_token is not None:
            on_token(tid)

    seq = Sequence(model, cache)
    decoder = Decoder(seq, Greedy, stop_ids=stop_ids, limit=max_new_tokens,
                      on_token=emit)
    decode([decoder], [seq.extend(prompt_ids)], speculator)
    if decoder.reason in ("end", "context_full"):
        emit(decoder.final)
    return decoder.ids + [decoder.final]
