"""Chat is a text protocol: messages rendered into one string by the model's template.

An instruct model was fine-tuned on conversations laid out with marker tokens.
Qwen (and SmolLM2) use ChatML:

    <|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n
    <|im_start|>user\\nWhat is the capital of France?<|im_end|>\\n
    <|im_start|>assistant\\n

and the model answers by continuing the string until it emits `<|im_end|>`.  The
template ships in the GGUF (`tokenizer.chat_template`, Jinja2; rendered within bounds
by chat_template.py, since it is code from a file); a file without one gets plain
ChatML.  The rendered text is encoded with `encode_raw`: the template owns every
structural token, BOS included.

`Conversation` is the loop around the model: it owns the KV cache, the history, the
sampler and a `StreamDecoder`; each turn prefills only the tokens the cache does not
already hold, then repeats sample -> stop check -> stream -> forward one token ->
commit.  With a `Speculator` (speculative.py) one forward step checks the sampled
token and a drafter's guesses, and commits every guess the sampler agrees with.
The conversation is the one owner of "the ids it lists are exactly the ids in its
cache, and its text is what they spell": only its own methods (`rewind`, `extend`,
`step`, `verify`, `accept`, `end_turn`) change the three, so an error or Ctrl-C
anywhere leaves a conversation that can go on.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import Sequence

from .chat_template import CHATML, ChatTemplate
from .kv_cache import common_prefix, prompt_fits
from .speculative import judge, verify_step
from .errors import ContextFull, FucinaError
from .sampler import Sampler, SamplerConfig
from .text_stream import THINK_CLOSE, THINK_OPEN, Stream, TextStream

# Markers that end a turn in the formats we know, as llama.cpp's end-of-generation
# set spells them; each one the vocabulary holds as a single special token stops.
END_MARKERS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>",
               "<|endoftext|>", "<|eom_id|>")
EMPTY_THINK = "<think>\n\n</think>\n\n"


class ChatFormat:
    """What a conversation needs to know of a model's chat protocol: its template,
    which ids end a turn, and whether (and how) it thinks."""

    def __init__(self, tokenizer, *, template: str | ChatTemplate | None = None,
                 name: str | None = None):
        if tokenizer is None:
            raise FucinaError("this model file has no tokenizer: it cannot chat")
        self.tokenizer = tokenizer
        if isinstance(template, ChatTemplate):
            self.template = template
        else:
            source = template if template is not None else tokenizer.chat_template
            if source:
                label = name or "tokenizer.chat_template"
            else:
                label = "ChatML (built in: the file has no chat template)"
            self.template = _cached_template(source or CHATML, label)
        self.end_marker, stops = None, set(tokenizer.eot_ids)
        for marker in END_MARKERS:
            tid = _single_special(tokenizer, marker)
            if tid is not None:
                stops.add(tid)
                if self.end_marker is None and marker in self.template.source:
                    self.end_marker = marker
        if self.end_marker is None and tokenizer.eos_id is not None:
            self.end_marker = tokenizer.decode([tokenizer.eos_id])
        self.stop_ids = frozenset(stops)
        think = (_single_special(tokenizer, THINK_OPEN),
                 _single_special(tokenizer, THINK_CLOSE))
        self.think_ids = think if None not in think else None

    @property
    def can_think(self) -> bool:
        """Does the vocabulary spell <think> and </think> as single tokens (Qwen3)?"""
        return self.think_ids is not None

    def render(self, messages: Sequence[dict], *, add_generation_prompt: bool = True,
               no_think: bool = False) -> str:
        """Render with the special tokens the template may ask for.

        no_think: a template that reads `enable_thinking` gets it (False); otherwise
        a model that can think gets the empty think block pre-filled after the
        generation prompt, so it believes it has already thought.  A model without
        think tokens never thinks, and no_think changes nothing."""
        tok = self.tokenizer
        variables = {
            "bos_token": tok.decode([tok.bos_id]) if tok.bos_id is not None else "",
            "eos_token": tok.decode([tok.eos_id]) if tok.eos_id is not None else "",
        }
        if no_think and self.template.reads_enable_thinking:
            variables["enable_thinking"] = False
        text = self.template.render(
            messages, add_generation_prompt=add_generation_prompt, **variables)
        if (no_think and add_generation_prompt and self.can_think
                and not self.template.reads_enable_thinking):
            text += EMPTY_THINK
        return text


@functools.lru_cache(maxsize=16)
def _cached_template(source: str, name: str) -> ChatTemplate:
    return ChatTemplate(source, name=name)


def _single_special(tokenizer, text: str) -> int | None:
    """The id of `text` if the vocabulary holds it as one special token."""
    raw = text.encode("utf-8")
    for marker, tid, _ in tokenizer.special_markers:
        if marker == raw:
            return tid
    return None


def render(tokenizer, messages: list[dict], *,
           add_generation_prompt: bool = True) -> str:
    """Render `messages` ([{"role": ..., "content": ...}]) with the model's template."""
    return ChatFormat(tokenizer).render(messages,
                                        add_generation_prompt=add_generation_prompt)


def render_prompt(tokenizer, user: str, system: str | None = None) -> str:
    """One user turn (optionally after a system message), ready for the answer."""
    messages = [{"role": "system", "content": system}] if system else []
    return render(tokenizer, messages + [{"role": "user", "content": user}])


# --- the conversation ------------------------------------------------------------

@dataclass
class Reply:
    """One answer, and what it cost.

    `text` is what was shown (think block hidden unless shown), `raw_text` all the
    model wrote up to the stop, `ids` the answer's tokens now in the KV cache (the
    end marker is not: it was sampled, recognized, and never fed back).
    `stop_reason`: "end" (the end marker), "stop_string", "max_tokens",
    "context_full" (no room left for another token) or "interrupted"."""

    text: str
    raw_text: str
    ids: list[int]
    stop_reason: str
    prefilled: int
    reused: int
    prefill_seconds: float
    decode_seconds: float
    drafted: int = 0            # speculation: guesses checked
    accepted: int = 0           # and those the model agreed with

    @property
    def decode_tokens_per_second(self) -> float:
        return len(self.ids) / self.decode_seconds if self.decode_seconds > 0 else 0.0

    def stats(self) -> str:
        """One line for a terminal."""
        pre = (f"prefill {self.prefilled} tokens in {self.prefill_seconds:.2f} s"
               + (f" ({self.reused} reused)" if self.reused else ""))
        spec = (f"; {self.accepted}/{self.drafted} drafted tokens accepted "
                f"({100 * self.accepted / self.drafted:.0f}%)" if self.drafted else "")
        return (f"[{len(self.ids)} tokens, {self.decode_tokens_per_second:.1f} tok/s; "
                f"{pre}{spec}; {self.stop_reason}]")


class _Turn:
    """One answer in progress: the prefix to prefill, then one token at a time.

    It changes the conversation only through the conversation's own methods, so
    `conv.tokens` are exactly the ids in `conv.cache` at every step; `conv.messages`
    changes once, when the answer is over, so it always ends with a complete turn."""

    def __init__(self, conv: "Conversation", messages: list[dict], stream: Stream,
                 whole: bool):
        self.conv, self.messages = conv, messages
        fmt, tok = conv.format, conv.format.tokenizer
        text = fmt.render(messages, no_think=conv.no_think)
        held, cached = conv.tokens, conv.cached_text
        if not whole and cached is not None and text.startswith(cached):
            keep = len(held)
            new = tok.encode_raw(text[len(cached):])
        else:  # the template rewrote history (or a whole conversation was sent)
            ids = tok.encode_raw(text)
            keep = common_prefix(held, ids)
            new = ids[keep:]
        if not new:  # nothing new: re-run the last token to get its logits
            if keep == 0:
                raise FucinaError(f"chat template {fmt.template.name} rendered nothing")
            keep -= 1
            new = held[keep:]
        capacity = conv.cache.capacity
        if not prompt_fits(keep + len(new), capacity):
            raise ContextFull(
                f"this turn needs {len(new)} new tokens (+1 to answer) but "
                f"{capacity - keep} of the conversation's {capacity} positions are "
                f"left; start over (reset) or use a larger context")
        self._start(text, keep, new, stream)

    def _start(self, text: str, keep: int, new: list[int], stream: Stream) -> None:
        """The state of a turn that keeps `keep` cached ids and prefills `new`."""
        conv = self.conv
        self.text, self.keep, self.new = text, keep, new
        self.streamer = TextStream(conv.format.tokenizer, stream, conv.stop,
                                  conv.show_think)
        self.ids: list[int] = []
        self.drafted = self.accepted = 0
        self.reason: str | None = None
        self.prefill_seconds = self.decode_seconds = 0.0
        self._t0 = 0.0
        self.started = False

    def prefill(self):
        conv = self.conv
        conv.rewind(self.keep)
        t0 = time.perf_counter()
        logits = conv.extend(self.new, self.text)
        self._t0 = time.perf_counter()
        self.prefill_seconds = self._t0 - t0
        self.started = True
        return logits

    def choose(self, logits, guess: int | None = None, q=None) -> int | None:
        """Sample the next token; None when the answer is over (`reason` says why).
        `guess` (and its draft distribution `q`): a drafter's guess for this
        position, judged by the speculative rule (speculative.judge)."""
        conv = self.conv
        limit = conv.max_response_tokens
        if limit is not None and len(self.ids) >= limit:
            self.reason = "max_tokens"
            return None
        tid = conv.sample(logits, guess, q)
        if tid in conv.format.stop_ids:
            self.reason = "end"
            return None
        if conv.cache.remaining < 1:
            self.reason = "context_full"
            return None
        if self.streamer.push(tid):
            self.reason = "stop_string"
            return None
        return tid

    def commit(self, tid: int) -> None:
        """`tid` went through the model (`Conversation.step`): part of the answer."""
        self.ids.append(tid)

    def speculate(self, tid: int, speculator) -> int | None:
        """Feed the chosen `tid` together with the drafter's guesses in one step;
        commit `tid` and every guess the sampler agrees with; the next chosen token
        (not yet fed), or None when the answer is over.

        The guesses fit the cache and the answer's token limit, so every check of
        `choose` (end marker, stop string, max_tokens, context) runs on each
        accepted token as it would without speculation."""
        conv = self.conv
        room = conv.cache.remaining - 1
        limit = conv.max_response_tokens
        if limit is not None:
            room = min(room, limit - len(self.ids) - 1)
        draft = speculator.propose(conv._tokens + [tid], room)
        rows = conv.verify([tid] + draft.ids)
        self.commit(tid)
        accepted, nxt = 0, None
        for i, guess in enumerate(draft.ids):
            nxt = self.choose(rows[i], guess, draft.q[i] if draft.q else None)
            if nxt != guess:
                break
            conv.accept(guess)
            self.commit(guess)
            accepted += 1
        else:
            nxt = self.choose(rows[len(draft.ids)])
        speculator.stats.record(len(draft.ids), accepted)
        self.drafted += len(draft.ids)
        self.accepted += accepted
        return nxt

    def finish(self, reason: str | None = None) -> Reply:
        conv, tok = self.conv, self.conv.format.tokenizer
        self.reason = reason or self.reason
        self.decode_seconds = time.perf_counter() - self._t0
        self.streamer.finish()
        raw = self.streamer.raw if self.streamer.stop_at is None \
            else self.streamer.raw[:self.streamer.stop_at]
        spelled = tok.decode(self.ids)
        content = spelled if self.reason != "stop_string" else raw
        conv.end_turn(self.messages + [{"role": "assistant", "content": content}],
                      self.text + spelled)
        return Reply(text=self.streamer.visible(), raw_text=raw, ids=list(self.ids),
                     stop_reason=self.reason, prefilled=len(self.new), reused=self.keep,
                     prefill_seconds=self.prefill_seconds,
                     decode_seconds=self.decode_seconds, drafted=self.drafted,
                     accepted=self.accepted)


class Conversation:
    """A multi-turn chat with one model: history, KV cache, sampler, streaming.

    Each `send` prefills only what the cache does not hold yet -- normally just the
    new turn: the rendered conversation is compared with the text already in the
    cache, and only the suffix is encoded (a Jinja template cannot render one turn
    alone: the first turn may add a default system prompt, a later one may rewrite
    history).  When the template *does* rewrite history (Qwen3 drops old think
    blocks), the ids are compared instead and the cache is rewound to the longest
    common prefix (`KvCache.truncate`), as `send_rendered` always does.

    `sampler`: a `Sampler` or `SamplerConfig`; default: the Qwen3 card's settings
    (0.6 / 20 / 0.95 for a model that thinks; 0.7 / 20 / 0.8 with no_think or for a
    model that cannot think -- also Qwen2.5's own settings).  `capacity`: positions
    of the KV cache (default min(context length, 4096)); a turn that does not fit
    raises `ContextFull` and changes nothing.  `max_response_tokens`: None runs
    until the end marker or a full cache.  `stop`: extra stop strings.
    `speculator` (speculative.py): draft and verify several tokens per step; the
    same tokens as without it for a deterministic drafter (prompt lookup, a greedy
    draft model), whatever the seed.  `send_batch` does not speculate: its batch
    already shares each read of the weights among the conversations.
    """

    def __init__(self, model, *, system: str | None = None,
                 sampler: Sampler | SamplerConfig | None = None,
                 capacity: int | None = None, cache_type: str = "f16",
                 max_response_tokens: int | None = None, no_think: bool = False,
                 show_think: bool = False, stop: Sequence[str] = (),
                 template: str | ChatTemplate | None = None, speculator=None):
        self.model = model
        self.speculator = speculator
        self.format = ChatFormat(model.tokenizer, template=template,
                                 name=f"tokenizer.chat_template of {model.path.name}")
        self.no_think, self.show_think = bool(no_think), bool(show_think)
        if not isinstance(sampler, Sampler):
            thinking = self.format.can_think and not self.no_think
            sampler = Sampler(sampler or SamplerConfig.qwen3(thinking=thinking))
        self.sampler = sampler
        context = model.config.context_length
        if capacity is not None and not 0 < capacity <= context:
            raise FucinaError(f"capacity must be in 1 .. {context} (the model's "
                              f"context length), got {capacity}")
        if max_response_tokens is not None and max_response_tokens < 1:
            raise FucinaError(f"max_response_tokens must be at least 1, "
                              f"got {max_response_tokens}")
        self.cache = model.new_cache(capacity, cache_type)
        self.max_response_tokens = max_response_tokens
        self.stop = tuple(stop)
        self.system = system
        self.messages: list[dict] = []
        self._tokens: list[int] = []     # exactly the ids in the cache
        self._pending: list[int] = []    # guesses verified past them (`verify`)
        self._text: str | None = ""      # the text those ids spell (None: unknown)
        self.reset(system)

    # --- what the cache holds: changed only here ---------------------------------

    @property
    def tokens(self) -> list[int]:
        """The ids in the KV cache, in order (a copy)."""
        return list(self._tokens)

    @property
    def cached_text(self) -> str | None:
        """The text the ids in the cache spell; None while it is not known (after a
        rewind whose prefill failed, or during an answer)."""
        return self._text

    @property
    def remaining(self) -> int:
        """Free positions in the KV cache."""
        return self.cache.remaining

    def rewind(self, n_tokens: int) -> None:
        """Keep only the first `n_tokens` ids in the cache (`KvCache.truncate`).  The
        text they spell is unknown until the next `extend` says: the ids decide."""
        self._pending = []
        if n_tokens < len(self._tokens):
            self.cache.truncate(n_tokens)
            del self._tokens[n_tokens:]
            self._text = None

    def extend(self, ids: Sequence[int], text: str | None = None):
        """Run `ids` through the model after the ids in the cache; the cache then
        holds both, and they spell `text` (None: not known).  The last logits."""
        self._pending = []
        logits = self.model.forward_step(ids, len(self._tokens), self.cache)
        self._tokens.extend(ids)
        self._text = text
        return logits

    def verify(self, ids: Sequence[int]):
        """Speculation's step: run `ids` (a chosen token, then guesses) after the
        cache; logits `[len(ids), vocab]`, each row bit-identical to a plain decode
        step's (speculative.verify_step).  Only ids[0] is committed; the guesses
        wait in the cache, past its length, until `accept` takes them in order (the
        next verify, extend, step or rewind forgets the rest)."""

        base = len(self._tokens)
        try:
            rows = verify_step(self.model, ids, self.cache)
        except BaseException:         # Ctrl-C mid-step: the cache keeps what we list
            self.cache.truncate(base)
            raise
        self.cache.truncate(base + 1)
        self._tokens.append(ids[0])
        self._text = None
        self._pending = list(ids[1:])
        return rows

    def accept(self, tid: int) -> None:
        """Commit the next pending guess (it must be `tid`): its K and V are already
        in the cache (`KvCache.advance`)."""
        if not self._pending or self._pending[0] != tid:
            raise FucinaError(f"token {tid} is not the next verified guess")
        del self._pending[0]
        self.cache.advance(1)
        self._tokens.append(tid)

    @staticmethod
    def step(conversations: Sequence["Conversation"], ids: Sequence[int]) -> list:
        """One more token for each conversation (`ids[i]` for the i-th) in one
        forward step, so the weights are read once for all of them; the logits of
        each.  Their text is unknown until `end_turn`."""
        model, caches = conversations[0].model, [c.cache for c in conversations]
        if len(caches) == 1:     # one stream: the plain decode step
            out = [model.forward_step(list(ids), caches[0].len, caches[0])]
        else:                    # N streams: the weights are read once
            out = model.forward_step_batch(list(ids), caches)
        for conv, tid in zip(conversations, ids):
            conv._pending = []
            conv._tokens.append(tid)
            conv._text = None
        return out

    def sample(self, logits, guess: int | None = None, q=None) -> int:
        """The sampler's next token (its penalties look back at the ids in the
        cache); with a drafter's `guess`, judged by speculative.judge."""
        if guess is None:
            return self.sampler.next(logits, self._tokens)

        return judge(self.sampler, logits, self._tokens, guess, q)

    def end_turn(self, messages: list[dict], text: str) -> None:
        """An answer is over: `messages` is the history now (it ends with that
        answer), and `text` what the ids in the cache spell."""
        self.messages = messages
        self._text = text

    def reset(self, system: str | None = ...) -> None:
        """Forget the conversation (keep or replace the system prompt).  The
        sampler's random stream continues: it is not rewound."""
        if system is not ...:
            self.system = system
        self.messages = [{"role": "system", "content": self.system}] \
            if self.system else []
        self.cache.truncate(0)
        self._tokens, self._text, self._pending = [], "", []

    # --- turns ---------------------------------------------------------------------

    def send(self, user: str, *, stream: Stream = None) -> Reply:
        """Ask one question; the answer streams to `stream` (a callable taking text,
        or a file-like writer) as it is generated."""
        if not isinstance(user, str) or not user.strip():
            raise FucinaError("the message is empty")
        turn = _Turn(self, self.messages + [{"role": "user", "content": user}],
                     stream, whole=False)
        return self._run([turn])[0]

    def send_rendered(self, messages: Sequence[dict], *,
                      stream: Stream = None) -> Reply:
        """Answer a whole conversation given as messages (as an OpenAI-style client
        sends it each time), reusing the cache up to the longest common token
        prefix with what it holds: rewind there, prefill the rest."""
        turn = _Turn(self, [dict(m) for m in messages], stream, whole=True)
        return self._run([turn])[0]

    @staticmethod
    def send_batch(conversations: Sequence["Conversation"], users: Sequence[str], *,
                   streams: Sequence[Stream] | None = None) -> list[Reply]:
        """One new turn for each of N conversations of the same model, decoded in
        lockstep: one `forward_step_batch` per step reads the weights once for all
        N (the batch-decode bandwidth win).  Each keeps its own sampler, so a
        seeded conversation draws the same numbers as it would alone."""
        convs = list(conversations)
        if not convs or len(users) != len(convs):
            raise FucinaError(f"{len(convs)} conversations but {len(users)} messages")
        if len({id(c) for c in convs}) != len(convs):
            raise FucinaError("a conversation appears twice in one batch")
        if any(c.model is not convs[0].model for c in convs):
            raise FucinaError("a batch needs conversations of one and the same model")
        streams = list(streams) if streams is not None else [None] * len(convs)
        for u in users:
            if not isinstance(u, str) or not u.strip():
                raise FucinaError("the message is empty")
        turns = [_Turn(c, c.messages + [{"role": "user", "content": u}], s, whole=False)
                 for c, u, s in zip(convs, users, streams)]
        return Conversation._run(turns)

    @staticmethod
    def _run(turns: list[_Turn]) -> list[Reply]:
        """Prefill each turn, then: sample -> stop check -> stream (in `choose`),
        one forward step for every answer still running (`step`), commit."""
        try:
            logits = [t.prefill() for t in turns]
            spec = turns[0].conv.speculator if len(turns) == 1 else None
            if spec is not None:       # one answer: draft and verify
                tid = turns[0].choose(logits[0])
                while tid is not None:
                    tid = turns[0].speculate(tid, spec)
                return [turns[0].finish()]
            running = list(range(len(turns)))
            while running:
                picks = {i: turns[i].choose(logits[i]) for i in running}
                running = [i for i in running if picks[i] is not None]
                if not running:
                    break
                ids = [picks[i] for i in running]
                out = Conversation.step([turns[i].conv for i in running], ids)
                for row, i in enumerate(running):
                    turns[i].commit(ids[row])
                    logits[i] = out[row]
        except KeyboardInterrupt:
            for t in turns:  # keep what is in the caches; a turn not prefilled is void
                if t.started:
                    t.finish("interrupted")
            raise
        return [t.finish() for t in turns]
