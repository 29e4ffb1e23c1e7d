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

`Conversation` is a chat over the generation core (generation.py): it owns the
history, the sampler and a `Sequence` (the KV cache and the ids in it); each turn
(`Turn`) prefills only the tokens the cache does not already hold, then runs the
one decode loop (`generation.decode`: sample -> stop check -> stream -> forward one
token -> commit; with a `Speculator`, draft and verify).  The sequence is the one
owner of "the ids it lists are exactly the ids in its cache, and its text is what
they spell", so an error or Ctrl-C anywhere leaves a conversation that can go on.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import Sequence

from .chat_template import (CHATML, END_MARKERS, ChatTemplate, end_of_turn_ids,
                            single_special)
from . import generation
from .generation import Decoder, decode
from .kv_cache import common_prefix, prompt_fits
from .errors import ContextFull, FucinaError
from .sampler import Sampler, SamplerConfig
from .text_stream import THINK_CLOSE, THINK_OPEN, Stream, TextStream
from .tool_calls import ToolUse, parse_tool_calls

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
        self.end_marker = None
        for marker in END_MARKERS:
            if (self.end_marker is None and marker in self.template.source
                    and single_special(tokenizer, marker) is not None):
                self.end_marker = marker
        if self.end_marker is None and tokenizer.eos_id is not None:
            self.end_marker = tokenizer.decode([tokenizer.eos_id])
        self.stop_ids = end_of_turn_ids(tokenizer)
        think = (single_special(tokenizer, THINK_OPEN),
                 single_special(tokenizer, THINK_CLOSE))
        self.think_ids = think if None not in think else None

    @property
    def can_think(self) -> bool:
        """Does the vocabulary spell <think> and </think> as single tokens (Qwen3)?"""
        return self.think_ids is not None

    def render(self, messages: Sequence[dict], *, add_generation_prompt: bool = True,
               no_think: bool = False, tools: Sequence[dict] | None = None) -> str:
        """Render with the special tokens the template may ask for.

        no_think: a template that reads `enable_thinking` gets it (False); otherwise
        a model that can think gets the empty think block pre-filled after the
        generation prompt, so it believes it has already thought.  A model without
        think tokens never thinks, and no_think changes nothing.  `tools`: the
        functions the model may call (tool_calls.py), which the template renders;
        a template that never reads `tools` cannot offer them (an error)."""
        tok = self.tokenizer
        variables = {
            "bos_token": tok.decode([tok.bos_id]) if tok.bos_id is not None else "",
            "eos_token": tok.decode([tok.eos_id]) if tok.eos_id is not None else "",
        }
        if no_think and self.template.reads_enable_thinking:
            variables["enable_thinking"] = False
        if tools:
            if "tools" not in self.template.source:
                raise FucinaError(f"chat template {self.template.name} does not render "
                                  "tools: this model was not taught to call them")
            variables["tools"] = list(tools)
        text = self.template.render(
            messages, add_generation_prompt=add_generation_prompt, **variables)
        if (no_think and add_generation_prompt and self.can_think
                and not self.template.reads_enable_thinking):
            text += EMPTY_THINK
        return text


@functools.lru_cache(maxsize=16)
def _cached_template(source: str, name: str) -> ChatTemplate:
    return ChatTemplate(source, name=name)


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
    logprobs: list | None = None    # generation.TokenLogprob per token, when asked

    @property
    def tool_calls(self) -> list:
        """The calls the answer made (tool_calls.ToolCall: name, arguments JSON)."""
        return parse_tool_calls(self.raw_text)[1]

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


class Turn:
    """One answer in progress: the prompt to prefill, then a `generation.Decoder`
    (choose, commit, speculate) with the conversation's sampler, stop rules and
    text stream.

    It changes the conversation only through its `Sequence` (generation.py), so
    `conv.tokens` are exactly the ids in `conv.cache` at every step;
    `conv.messages` changes once, when the answer is over (`finish`), so it always
    ends with a complete turn.  Made by `for_messages` (chat: render, keep what the
    cache holds) or `for_ids` (the server: a prompt already rendered and encoded).
    `logprobs` (k): record each token's log-probability and k alternatives
    (`Decoder`), given back in `Reply.logprobs`."""

    def __init__(self, conv: "Conversation", messages: list[dict], text: str,
                 keep: int, new: list[int], stream: Stream,
                 logprobs: int | None = None, follow_up: bool = False):
        self.conv, self.messages = conv, messages
        self.text, self.keep, self.new = text, keep, new
        self.streamer = TextStream(conv.format.tokenizer, stream, conv.stop,
                                   conv.show_think)
        conv.tool_processor(follow_up)   # a fresh grammar state for each answer
        self.decoder = Decoder(conv.seq, conv.sampler, stop_ids=conv.format.stop_ids,
                               limit=conv.max_response_tokens,
                               on_token=self.streamer.push, keep_final=True,
                               logprobs=logprobs)
        self.done = 0                    # ids of `new` prefilled so far
        self.prefill_seconds = self.decode_seconds = 0.0
        self._t0 = self._t_prefill = 0.0
        self.started = False

    @classmethod
    def for_messages(cls, conv: "Conversation", messages: list[dict], stream: Stream,
                     whole: bool, follow_up: bool = False) -> "Turn":
        """Render `messages`; keep the cached ids their text (or, when the
        template rewrote history or `whole`, their ids) starts with."""
        fmt, tok = conv.format, conv.format.tokenizer
        entries = conv.tools.entries if conv.tools else None
        text = fmt.render(messages, no_think=conv.no_think, tools=entries)
        held, cached = conv.tokens, conv.cached_text
        if not whole and cached is not None and text.startswith(cached):
            keep, new = len(held), tok.encode_raw(text[len(cached):])
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
        return cls(conv, messages, text, keep, new, stream, follow_up=follow_up)

    @classmethod
    def for_ids(cls, conv: "Conversation", ids: Sequence[int], text: str,
                stream: Stream, logprobs: int | None = None) -> "Turn":
        """A prompt given as ids (and the text they spell): keep the longest
        common prefix of the cached ids and the prompt, prefill the rest."""
        ids = list(ids)
        keep = common_prefix(conv.tokens, ids)
        if keep == len(ids):   # all cached: re-run the last id to get its logits
            keep -= 1
        capacity = conv.cache.capacity
        if not prompt_fits(len(ids), capacity):
            raise ContextFull(f"the prompt has {len(ids)} tokens (+1 to answer) but "
                              f"a slot holds {capacity} positions")
        return cls(conv, [], text, keep, ids[keep:], stream, logprobs)

    def prefill(self, chunk: int | None = None):
        """Prefill up to `chunk` more ids of the prompt (default: all); the last
        logits once it is all in the cache (the turn has `started`), else None.
        Until then the cached text is unknown, and a turn dropped half-way leaves
        ids in the cache that are a valid prefix for the next one."""
        seq = self.conv.seq
        if self.done == 0:
            seq.rewind(self.keep)
            self._t_prefill = time.perf_counter()
        n = len(self.new) if chunk is None else chunk
        part = self.new[self.done:self.done + n]
        self.done += len(part)
        last = self.done == len(self.new)
        logits = seq.extend(part, self.text if last else None)
        if not last:
            return None
        self._t0 = time.perf_counter()
        self.prefill_seconds = self._t0 - self._t_prefill
        self.started = True
        return logits

    def finish(self, reason: str | None = None) -> Reply:
        """The answer is over (`reason` overrides the decoder's: "interrupted"):
        the history gains it, and the reply says what it cost."""
        conv, tok, dec = self.conv, self.conv.format.tokenizer, self.decoder
        if reason is None:
            dec.feed_final()         # a token cut by the limit: the cache keeps it
        reason = reason or dec.reason
        self.decode_seconds = time.perf_counter() - self._t0
        self.streamer.finish()
        raw = self.streamer.raw if self.streamer.stop_at is None \
            else self.streamer.raw[:self.streamer.stop_at]
        content = tok.decode(dec.ids) if reason != "stop_string" else raw
        conv.end_turn(self.messages + [{"role": "assistant", "content": content}],
                      self.text + tok.decode(dec.ids))
        return Reply(text=self.streamer.visible(), raw_text=raw, ids=list(dec.ids),
                     stop_reason=reason, prefilled=len(self.new), reused=self.keep,
                     prefill_seconds=self.prefill_seconds,
                     decode_seconds=self.decode_seconds, drafted=dec.drafted,
                     accepted=dec.accepted,
                     logprobs=None if dec.logprobs is None else list(dec.logprobs))


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
                 template: str | ChatTemplate | None = None, speculator=None,
                 tools: Sequence[dict] | None = None, tool_choice="auto"):
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
        self.seq = generation.Sequence(model, self.cache)   # the ids in the cache, and their text
        self.max_response_tokens = max_response_tokens
        self.stop = tuple(stop)
        self.tools = ToolUse(tools, tool_choice, model.tokenizer) if tools else None
        self.system = system
        self.messages: list[dict] = []
        self.reset(system)

    # --- what the cache holds: its Sequence (generation.py) -------------------------

    @property
    def tokens(self) -> list[int]:
        """The ids in the KV cache, in order (a copy)."""
        return self.seq.tokens

    @property
    def cached_text(self) -> str | None:
        """The text the ids in the cache spell; None while it is not known (after a
        rewind whose prefill failed, or during an answer)."""
        return self.seq.text

    @property
    def remaining(self) -> int:
        """Free positions in the KV cache."""
        return self.cache.remaining

    def rewind(self, n_tokens: int) -> None:
        """Keep only the first `n_tokens` ids in the cache (`Sequence.rewind`)."""
        self.seq.rewind(n_tokens)

    def extend(self, ids: Sequence[int], text: str | None = None):
        """Prefill `ids` after the cache (`Sequence.extend`); the last logits."""
        return self.seq.extend(ids, text)

    def verify(self, ids: Sequence[int]):
        """Speculation's step (`Sequence.verify`)."""
        return self.seq.verify(ids)

    def accept(self, tid: int) -> None:
        """Commit the next verified guess (`Sequence.accept`)."""
        self.seq.accept(tid)

    @staticmethod
    def step(conversations: Sequence["Conversation"], ids: Sequence[int]) -> list:
        """One more token for each conversation in one forward step
        (`Sequence.step`); the logits of each."""
        return generation.Sequence.step([c.seq for c in conversations], ids)

    def end_turn(self, messages: list[dict], text: str) -> None:
        """An answer is over: `messages` is the history now (it ends with that
        answer), and `text` what the ids in the cache spell."""
        self.messages = messages
        self.seq.text = text

    def reset(self, system: str | None = ...) -> None:
        """Forget the conversation (keep or replace the system prompt).  The
        sampler's random stream continues: it is not rewound."""
        if system is not ...:
            self.system = system
        self.messages = [{"role": "system", "content": self.system}] \
            if self.system else []
        self.seq.reset()

    # --- turns ---------------------------------------------------------------------

    def send(self, user: str, *, stream: Stream = None) -> Reply:
        """Ask one question; the answer streams to `stream` (a callable taking text,
        or a file-like writer) as it is generated."""
        if not isinstance(user, str) or not user.strip():
            raise FucinaError("the message is empty")
        turn = Turn.for_messages(self, self.messages + [{"role": "user",
                                                          "content": user}],
                                 stream, whole=False)
        return self._run([turn])[0]

    def tool_processor(self, follow_up: bool = False) -> None:
        """Give the sampler a fresh tool grammar for the next answer (`tools`;
        `follow_up`: the answer to tool results), or take the last one away when
        `tools` was cleared."""
        if self.tools is not None:
            self.sampler.logit_processor = self._tool_grammar = \
                self.tools.processor(follow_up)
        elif self.sampler.logit_processor is getattr(self, "_tool_grammar", None):
            self.sampler.logit_processor = self._tool_grammar = None

    def send_tool_results(self, results: Sequence[str], *,
                          stream: Stream = None) -> Reply:
        """The results of the calls the last answer made (`Reply.tool_calls`), in
        order, as `tool` messages; the model's answer to them."""
        if not results or not all(isinstance(r, str) for r in results):
            raise FucinaError("give one result (text) per tool call")
        tool = [{"role": "tool", "content": r} for r in results]
        turn = Turn.for_messages(self, self.messages + tool, stream, whole=False,
                                 follow_up=True)
        return self._run([turn])[0]

    def send_rendered(self, messages: Sequence[dict], *,
                      stream: Stream = None) -> Reply:
        """Answer a whole conversation given as messages (as an OpenAI-style client
        sends it each time), reusing the cache up to the longest common token
        prefix with what it holds: rewind there, prefill the rest."""
        turn = Turn.for_messages(self, [dict(m) for m in messages], stream, whole=True)
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
        turns = [Turn.for_messages(c, c.messages + [{"role": "user", "content": u}],
                                   s, whole=False)
                 for c, u, s in zip(convs, users, streams)]
        return Conversation._run(turns)

    @staticmethod
    def _run(turns: list[Turn]) -> list[Reply]:
        """Prefill each turn, then the one decode loop (generation.decode)."""
        try:
            logits = [t.prefill() for t in turns]
            spec = turns[0].conv.speculator if len(turns) == 1 else None
            decode([t.decoder for t in turns], logits, spec)
        except KeyboardInterrupt:
            for t in turns:  # keep what is in the caches; a turn not prefilled is void
                if t.started:
                    t.finish("interrupted")
            raise
        return [t.finish() for t in turns]
