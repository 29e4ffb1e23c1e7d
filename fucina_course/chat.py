"""Chat is a text protocol: messages rendered into one string by the model's template.

An instruct model was fine-tuned on conversations laid out with marker tokens.
Qwen (and SmolLM2) use ChatML:

    <|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n
    <|im_start|>user\\nWhat is the capital of France?<|im_end|>\\n
    <|im_start|>assistant\\n

and the model answers by continuing the string until it emits `<|im_end|>`.  The
template ships in the GGUF (`tokenizer.chat_template`, Jinja2); a file without one
gets plain ChatML.  The rendered text is encoded with `encode_raw`: the template
owns every structural token, BOS included.

A template is code from the model file, so it is untrusted: it runs in Jinja's
immutable sandbox (the fix llama-cpp-python shipped for its template-injection
CVE), and `ChatTemplate` bounds what the sandbox does not -- time, the size of
every value and of the output -- and turns every exception into one `FucinaError`
that names the template.

`Conversation` is the loop around the model: it owns the KV cache, the history,
the sampler and a `StreamDecoder`; each turn prefills only the tokens the cache
does not already hold, then repeats sample -> stop check -> stream -> forward one
token -> commit.
"""

from __future__ import annotations

import functools
import json
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence, TextIO

from .errors import ContextFull, FucinaError
from .sampler import Sampler, SamplerConfig

# ChatML, the conversation format of every Qwen instruct model, and the fallback for
# a file without a template (qwen_vocab.py writes this same constant into the
# vocabulary-only GGUF it builds).
CHATML = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Markers that end a turn in the formats we know, as llama.cpp's end-of-generation
# set spells them; each one the vocabulary holds as a single special token stops.
END_MARKERS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>",
               "<|endoftext|>", "<|eom_id|>")
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
EMPTY_THINK = "<think>\n\n</think>\n\n"


# --- templates: rendering untrusted Jinja within bounds ----------------------------

class TemplateLimitExceeded(BaseException):
    """Raised inside a render when a bound is hit.  A BaseException, so no
    `except Exception` between the template and `ChatTemplate.render` swallows it."""


class _TemplateRaised(Exception):
    """The template called raise_exception(message): its own, deliberate error."""


def _weight(value, budget: int) -> int:
    """About how many characters `value` prints as (strings, numbers, containers
    walked); stops counting once past `budget`, so it is cheap even for a list
    that holds itself a million times over."""
    total, stack = 0, [value]
    while stack and total <= budget:
        v = stack.pop()
        if isinstance(v, (str, bytes)):
            total += len(v)
        elif isinstance(v, int):
            total += v.bit_length() // 3 + 1
        elif isinstance(v, (list, tuple, set, frozenset)):
            total += len(v) + 1
            if total <= budget:
                stack.extend(v)
        elif isinstance(v, dict):
            total += len(v) + 1
            if total <= budget:
                stack.extend(v.keys())
                stack.extend(v.values())
        elif type(v).__name__ == "Namespace":
            stack.append(object.__getattribute__(v, "_Namespace__attrs"))
        else:
            total += 1
    return total


class _Budget:
    """The bounds of one `ChatTemplate`, read by its sandbox.  `cap` (characters a
    value may print as) is set per render: a fixed allowance plus room for the
    messages' own text."""

    def __init__(self, max_chars: int, max_int_bits: int):
        self.max_chars, self.bits, self.cap = max_chars, max_int_bits, max_chars

    def check(self, n: int, what: str) -> None:
        if n > self.cap:
            raise TemplateLimitExceeded(f"{what} of {n:,} characters or items "
                                        "exceeds the template limit")

    def check_value(self, value, what: str = "a value") -> None:
        self.check(_weight(value, self.cap), what)

    def check_format(self, fmt: str, args) -> None:
        # A width or precision in a format spec allocates that many characters.
        if any(len(d) > 7 or int(d) > self.cap
               for d in "".join(c if c.isdigit() else " " for c in fmt).split()):
            raise TemplateLimitExceeded("a field width in a format string exceeds "
                                        "the template limit")
        for a in args:
            if isinstance(a, int) and abs(a) > self.cap:
                raise TemplateLimitExceeded("a format argument exceeds the template "
                                            "limit")
            self.check_value(a, "a formatted value")


# Filters that turn their input into text: its printed size is checked first.
_TEXT_FILTERS = frozenset((
    "capitalize", "center", "e", "escape", "forceescape", "format", "indent", "join",
    "lower", "pprint", "replace", "string", "striptags", "title", "tojson", "trim",
    "truncate", "upper", "urlencode", "urlize", "wordwrap", "xmlattr"))


def _make_environment(budget: _Budget):
    """An immutable Jinja sandbox whose operators, method calls, filters, `~`
    and output check sizes *before* they allocate: a string of 10**10 characters
    must never exist, not even for the moment it takes to raise MemoryError."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def sized(x):
        return isinstance(x, (str, bytes, list, tuple))

    class BoundedSandbox(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "**", "+", "%"})

        def call_binop(self, context, op, left, right):
            if op == "*" and isinstance(left, int) and isinstance(right, int):
                if left.bit_length() + right.bit_length() > budget.bits:
                    raise TemplateLimitExceeded("an integer product exceeds the "
                                                "template limit")
            elif op == "*" and (sized(left) or sized(right)):
                seq, n = (left, right) if sized(left) else (right, left)
                if isinstance(n, int):
                    budget.check(_weight(seq, budget.cap) * max(n, 0),
                                 "a repeated sequence")
            elif op == "**" and isinstance(left, int) and isinstance(right, int):
                if right > 0 and abs(left) > 1 and \
                        right * left.bit_length() > budget.bits:
                    raise TemplateLimitExceeded("an integer power exceeds the "
                                                "template limit")
            elif op == "+" and sized(left) and sized(right):
                budget.check(_weight(left, budget.cap) + _weight(right, budget.cap),
                             "a concatenation")
            elif op == "%" and isinstance(left, str):
                budget.check_format(left, right if isinstance(right, tuple)
                                    else (right,))
            return super().call_binop(context, op, left, right)

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805
            target = getattr(__obj, "__wrapped__", __obj)
            owner = getattr(target, "__self__", None)
            name = getattr(target, "__name__", "")
            if isinstance(owner, str):
                values = (*args, *kwargs.values())
                if name in ("center", "ljust", "rjust", "zfill", "expandtabs"):
                    budget.check(max([a for a in values if isinstance(a, int)],
                                     default=0), f"str.{name}")
                elif name in ("format", "format_map"):
                    budget.check_format(owner, values)
                elif name == "replace" and len(args) >= 2:
                    old, new = str(args[0]), str(args[1])
                    n = owner.count(old) if old else len(owner) + 1
                    budget.check(len(owner) + max(len(new) - len(old), 0) * n,
                                 "str.replace")
                elif name == "join" and args:
                    items = list(args[0])
                    budget.check(len(owner) * len(items)
                                 + _weight(items, budget.cap), "str.join")
                    args = (items, *args[1:])
            return super().call(__context, __obj, *args, **kwargs)

    def finalize(value):  # every {{ ... }} passes here before it becomes text
        budget.check_value(value, "an output value")
        return value

    env = BoundedSandbox(trim_blocks=True, lstrip_blocks=True, finalize=finalize,
                         extensions=["jinja2.ext.loopcontrols"])

    def bounded_filter(name, f):
        skip = 2 if getattr(f, "jinja_pass_arg", None) else 1  # [context,] value

        @functools.wraps(f)
        def wrapper(*args, **kwargs):
            for a in (*args[skip:], *kwargs.values()):
                if isinstance(a, int) and abs(a) > budget.cap:
                    raise TemplateLimitExceeded(f"the argument {a} of the filter "
                                                f"{name!r} exceeds the template limit")
            if name in _TEXT_FILTERS and len(args) >= skip:
                value = args[skip - 1]
                if name == "join":
                    value = list(value)
                    args = (*args[:skip - 1], value, *args[skip:])
                rest = (*args[skip:], *kwargs.values())
                size = _weight(value, budget.cap) + _weight(rest, budget.cap)
                if name in ("join", "replace", "indent", "wordwrap"):
                    n = len(value) if name == "join" else str(value).count(
                        str(args[skip]) if name == "replace" and len(args) > skip
                        else "\n") + 1
                    size += n * _weight(rest, budget.cap)   # the argument, repeated
                if name == "format":
                    budget.check_format(str(value), rest)
                budget.check(size, f"the filter {name!r}")
            if name == "sum":
                budget.check(_weight((*args[skip - 1:], *kwargs.values()), budget.cap),
                             "the filter 'sum'")
            return f(*args, **kwargs)
        return wrapper

    def tojson(value, indent=None):
        # Hugging Face's version (templates are written for it): no HTML escaping.
        return json.dumps(value, ensure_ascii=False, indent=indent)

    env.filters["tojson"] = tojson
    env.filters.update({n: bounded_filter(n, f) for n, f in env.filters.items()})

    def raise_exception(message):
        raise _TemplateRaised(str(message))

    def strftime_now(fmt):
        return time.strftime(str(fmt))

    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now)
    return env


class ChatTemplate:
    """A compiled chat template that renders untrusted Jinja within bounds.

    The sandbox limits what a template may *touch* (no Python internals, no
    mutation of lists).  It does not limit what a template may *compute*, and a
    template is code from a downloaded file.  So, per render:

    * time: a trace function checks a deadline on every line the template runs
      and on every call it makes (10**5 x 10**5 nested loops stop at the budget);
    * size: operators, string methods, filters, `~` and `{{ }}` that can make big
      values (`'x' * n`, `2 ** n`, `'%*d'`, `center`, `replace`, `join`, printing a
      list that nests itself ...) are checked *before* they run, and the values a
      template stores are re-checked as it runs; the output is capped as it grows;
    * errors: every exception (ZeroDivisionError, RecursionError, OverflowError,
      MemoryError, ValueError, TypeError from `{% include %}` ...) becomes one
      FucinaError naming the template.

    Rejected alternative: rendering in a child process under rlimits bounds
    everything at once, but costs a Python start-up per turn and is not portable;
    a legitimate template never comes near these limits, and the checks cost a
    few milliseconds on a 400-message conversation.
    """

    def __init__(self, source: str | None = None, *, name: str = "ChatML (built in)",
                 time_budget: float = 2.0, max_chars: int = 1 << 20,
                 max_int_bits: int = 1 << 16):
        self.source = source if source is not None else CHATML
        self.name = name
        self.time_budget = float(time_budget)
        self._budget = _Budget(int(max_chars), int(max_int_bits))
        self._template = self._guard(self._compile)

    @property
    def reads_enable_thinking(self) -> bool:
        """Does the template itself switch thinking off (Qwen3's `enable_thinking`)?"""
        return "enable_thinking" in self.source

    def render(self, messages: Sequence[dict], *, add_generation_prompt: bool = True,
               **variables) -> str:
        """The conversation as text; `variables` (bos_token, enable_thinking, tools,
        ...) go to the template as they are."""
        if not messages:
            raise FucinaError(f"chat template {self.name}: no messages to render")
        context = dict(variables, messages=list(messages),
                       add_generation_prompt=add_generation_prompt)
        # Room for the conversation's own text (a template may quote it a few
        # times), not for amplification.
        cap = self._budget.max_chars + 4 * _weight(context, 1 << 40)
        return self._guard(lambda: self._run(context, cap))

    # --- internals ---------------------------------------------------------------

    def _compile(self):
        template = _make_environment(self._budget).from_string(self.source)
        names = template.root_render_func.__globals__  # the compiled module's
        for name in ("str_join", "markup_join"):       # `a ~ b` joins through these
            join = names.get(name)
            if join is not None:
                names[name] = self._bounded_join(join)
        return template

    def _bounded_join(self, join):
        budget = self._budget

        def bounded(seq):
            seq = list(seq)
            budget.check(_weight(seq, budget.cap), "a `~` concatenation")
            return join(seq)
        return bounded

    def _run(self, context: dict, cap: int) -> str:
        budget, deadline = self._budget, time.monotonic() + self.time_budget
        budget.cap = cap
        lines = [0]

        def late():
            return TemplateLimitExceeded(f"rendering took longer than "
                                         f"{self.time_budget:g} s")

        def on_line(frame, event, arg):
            if time.monotonic() > deadline:
                raise late()
            if event == "line":
                lines[0] += 1
                if lines[0] % 8 == 0:  # a second net behind the checks above
                    for v in frame.f_locals.values():
                        budget.check_value(v, "a template variable")
            return on_line

        def on_call(frame, event, arg):
            if time.monotonic() > deadline:
                raise late()
            return on_line if frame.f_code.co_filename == "<template>" else None

        parts, total = [], 0
        previous = sys.gettrace()
        sys.settrace(on_call)
        try:
            for piece in self._template.generate(**context):
                total += len(piece)
                if total > cap:
                    raise TemplateLimitExceeded(f"the output exceeds {cap:,} "
                                                "characters")
                parts.append(piece)
        finally:
            sys.settrace(previous)
        return "".join(parts)

    def _guard(self, fn):
        try:
            return fn()
        except TemplateLimitExceeded as e:
            raise FucinaError(f"chat template {self.name}: {e}") from None
        except _TemplateRaised as e:
            raise FucinaError(f"chat template {self.name} refused: {e}") from None
        except FucinaError as e:
            raise FucinaError(f"chat template {self.name}: {e}") from None
        except RecursionError:
            raise FucinaError(f"chat template {self.name}: too deep a recursion "
                              "(a macro calling itself?)") from None
        except Exception as e:  # anything a template can raise, MemoryError included
            detail = str(e).splitlines()[0] if str(e) else ""
            raise FucinaError(f"chat template {self.name}: {type(e).__name__}"
                              + (f": {detail}" if detail else "")) from None


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


# --- streaming -----------------------------------------------------------------------

Stream = Callable[[str], object] | TextIO | None


def without_think(text: str) -> str:
    """`text` with every <think>...</think> block (and the newlines after it)
    removed; an unclosed block hides everything after it (the model is thinking)."""
    out, i = [], 0
    while True:
        j = text.find(THINK_OPEN, i)
        if j < 0:
            out.append(text[i:])
            return "".join(out)
        out.append(text[i:j])
        k = text.find(THINK_CLOSE, j)
        if k < 0:
            return "".join(out)
        i = k + len(THINK_CLOSE)
        while i < len(text) and text[i] == "\n":
            i += 1


class _Streamer:
    """Decoded text of one answer -> the writer, minus what must not be shown.

    Bytes go through the tokenizer's `StreamDecoder` (no half characters); text
    that could be the start of a stop string is held back until it is known not to
    be one (so a stop string is never shown); a think block is hidden unless asked
    for."""

    def __init__(self, tokenizer, stream: Stream, stops: Sequence[str],
                 show_think: bool):
        self.decoder = tokenizer.stream(skip_special=True)
        if stream is None:
            self.write = None
        elif callable(stream):
            self.write = stream
        else:
            def write(text, _f=stream):
                _f.write(text)
                if hasattr(_f, "flush"):
                    _f.flush()
            self.write = write
        self.stops = [s for s in stops if s]
        self.show_think = show_think
        self.raw, self.shown, self.stop_at = "", 0, None

    def push(self, tid: int) -> bool:
        """Add one token; True if it completed a stop string."""
        self.raw += self.decoder.push(tid)
        return self._emit(final=False)

    def finish(self) -> None:
        if self.stop_at is None:
            self.raw += self.decoder.flush()
        self._emit(final=True)

    def visible(self) -> str:
        text = self.raw if self.stop_at is None else self.raw[:self.stop_at]
        return text if self.show_think else without_think(text)

    def _emit(self, final: bool) -> bool:
        if self.stop_at is None:
            hits = [i for i in (self.raw.find(s) for s in self.stops) if i >= 0]
            if hits:
                self.stop_at, final = min(hits), True
        end = len(self.raw) if self.stop_at is None else self.stop_at
        if not final:
            hold = 0
            for s in self.stops:
                for n in range(min(len(s) - 1, end), hold, -1):
                    if self.raw.endswith(s[:n], 0, end):
                        hold = n
                        break
            end -= hold
        text = self.raw[:end] if self.show_think else without_think(self.raw[:end])
        if len(text) > self.shown:
            if self.write is not None:
                self.write(text[self.shown:])
            self.shown = len(text)
        return self.stop_at is not None


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

    @property
    def decode_tokens_per_second(self) -> float:
        return len(self.ids) / self.decode_seconds if self.decode_seconds > 0 else 0.0

    def stats(self) -> str:
        """One line for a terminal."""
        pre = (f"prefill {self.prefilled} tokens in {self.prefill_seconds:.2f} s"
               + (f" ({self.reused} reused)" if self.reused else ""))
        return (f"[{len(self.ids)} tokens, {self.decode_tokens_per_second:.1f} tok/s; "
                f"{pre}; {self.stop_reason}]")


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two id lists."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class _Turn:
    """One answer in progress: the prefix to prefill, then one token at a time.

    Invariant kept at every step (so an exception or Ctrl-C anywhere leaves the
    conversation usable): `conv.tokens` are exactly the ids in `conv.cache`, and
    `conv.messages` ends with a complete turn."""

    def __init__(self, conv: "Conversation", messages: list[dict], stream: Stream,
                 whole: bool):
        self.conv, self.messages = conv, messages
        fmt, tok = conv.format, conv.format.tokenizer
        text = fmt.render(messages, no_think=conv.no_think)
        if not whole and conv._text is not None and text.startswith(conv._text):
            keep = len(conv.tokens)
            new = tok.encode_raw(text[len(conv._text):])
        else:  # the template rewrote history (or a whole conversation was sent)
            ids = tok.encode_raw(text)
            keep = common_prefix(conv.tokens, ids)
            new = ids[keep:]
        if not new:  # nothing new: re-run the last token to get its logits
            if keep == 0:
                raise FucinaError(f"chat template {fmt.template.name} rendered nothing")
            keep -= 1
            new = conv.tokens[keep:]
        capacity = conv.cache.capacity
        if keep + len(new) + 1 > capacity:
            raise ContextFull(
                f"this turn needs {len(new)} new tokens (+1 to answer) but "
                f"{capacity - keep} of the conversation's {capacity} positions are "
                f"left; start over (reset) or use a larger context")
        self.text, self.keep, self.new = text, keep, new
        self.streamer = _Streamer(tok, stream, conv.stop, conv.show_think)
        self.ids: list[int] = []
        self.reason: str | None = None
        self.prefill_seconds = self.decode_seconds = 0.0
        self._t0 = 0.0
        self.started = False

    def prefill(self):
        conv = self.conv
        if self.keep < len(conv.tokens):
            conv.cache.truncate(self.keep)
            del conv.tokens[self.keep:]
            conv._text = None  # unknown until the prefill succeeds: ids decide
        t0 = time.perf_counter()
        logits = conv.model.forward_step(self.new, self.keep, conv.cache)
        conv.tokens.extend(self.new)
        conv._text = self.text
        self._t0 = time.perf_counter()
        self.prefill_seconds = self._t0 - t0
        self.started = True
        return logits

    def choose(self, logits) -> int | None:
        """Sample the next token; None when the answer is over (`reason` says why)."""
        conv = self.conv
        limit = conv.max_response_tokens
        if limit is not None and len(self.ids) >= limit:
            self.reason = "max_tokens"
            return None
        tid = conv.sampler.next(logits, conv.tokens)
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
        """`tid` went through the model: it is in the cache now."""
        self.conv.tokens.append(tid)
        self.ids.append(tid)

    def finish(self, reason: str | None = None) -> Reply:
        conv, tok = self.conv, self.conv.format.tokenizer
        self.reason = reason or self.reason
        self.decode_seconds = time.perf_counter() - self._t0
        self.streamer.finish()
        raw = self.streamer.raw if self.streamer.stop_at is None \
            else self.streamer.raw[:self.streamer.stop_at]
        spelled = tok.decode(self.ids)
        content = spelled if self.reason != "stop_string" else raw
        conv.messages = self.messages + [{"role": "assistant", "content": content}]
        conv._text = self.text + spelled
        return Reply(text=self.streamer.visible(), raw_text=raw, ids=list(self.ids),
                     stop_reason=self.reason, prefilled=len(self.new), reused=self.keep,
                     prefill_seconds=self.prefill_seconds,
                     decode_seconds=self.decode_seconds)


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
    """

    def __init__(self, model, *, system: str | None = None,
                 sampler: Sampler | SamplerConfig | None = None,
                 capacity: int | None = None, cache_type: str = "f16",
                 max_response_tokens: int | None = None, no_think: bool = False,
                 show_think: bool = False, stop: Sequence[str] = (),
                 template: str | ChatTemplate | None = None):
        self.model = model
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
        self.tokens: list[int] = []      # exactly the ids in the cache
        self._text = ""                  # the text those ids spell
        self.reset(system)

    @property
    def remaining(self) -> int:
        """Free positions in the KV cache."""
        return self.cache.remaining

    def reset(self, system: str | None = ...) -> None:
        """Forget the conversation (keep or replace the system prompt).  The
        sampler's random stream continues: it is not rewound."""
        if system is not ...:
            self.system = system
        self.messages = [{"role": "system", "content": self.system}] \
            if self.system else []
        self.cache.truncate(0)
        self.tokens, self._text = [], ""

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
        one forward step for every answer still running, commit."""
        model = turns[0].conv.model
        try:
            logits = [t.prefill() for t in turns]
            running = list(range(len(turns)))
            while running:
                picks = {i: turns[i].choose(logits[i]) for i in running}
                running = [i for i in running if picks[i] is not None]
                if not running:
                    break
                ids = [picks[i] for i in running]
                caches = [turns[i].conv.cache for i in running]
                if len(running) == 1:    # one stream: the plain decode step
                    out = [model.forward_step(ids, caches[0].len, caches[0])]
                else:                    # N streams: the weights are read once
                    out = model.forward_step_batch(ids, caches)
                for row, i in enumerate(running):
                    turns[i].commit(ids[row])
                    logits[i] = out[row]
        except KeyboardInterrupt:
            for t in turns:  # keep what is in the caches; a turn not prefilled is void
                if t.started:
                    t.finish("interrupted")
            raise
        return [t.finish() for t in turns]
