"""Chat templates: a model file's Jinja code, rendered within bounds.

The template that turns a conversation into text ships in the GGUF
(`tokenizer.chat_template`), and a GGUF comes from anywhere: a template is untrusted
code.  It runs in Jinja's immutable sandbox (the fix llama-cpp-python shipped for its
template-injection CVE), which limits what it may *touch*; `ChatTemplate` bounds what
it may *compute* -- time, the size of every value and of the output -- and turns every
exception into one `FucinaError` that names the template.

The invariant: a size is checked *before* the value is made.  A string of 10**10
characters must never exist, not even for the moment it takes to raise MemoryError, so
every operator, string method, filter, `~` and `{{ }}` that allocates by an argument
first asks the render's `_Budget` (the `_check_*` functions below, one per kind of
operation).

Jinja itself is imported when the first template compiles, not with this module
(importing it takes 50-120 ms here): `CHATML` is wanted without it (qwen_vocab.py
writes it into the vocabulary-only GGUF it builds).
"""

from __future__ import annotations

import functools
import json
import sys
import time
from typing import Sequence

from .errors import FucinaError

# ChatML, the conversation format of every Qwen instruct model, and the fallback for
# a file without a template (qwen_vocab.py writes this same constant into the
# vocabulary-only GGUF it builds).
CHATML = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


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


# --- the checks: each runs *before* the operation it guards ------------------------

def _sized(x) -> bool:
    return isinstance(x, (str, bytes, list, tuple))


def _check_binop(budget: _Budget, op: str, left, right) -> None:
    """`*`, `**`, `+` and `%` on values that would make a number or a string too big."""
    if op == "*" and isinstance(left, int) and isinstance(right, int):
        if left.bit_length() + right.bit_length() > budget.bits:
            raise TemplateLimitExceeded("an integer product exceeds the "
                                        "template limit")
    elif op == "*" and (_sized(left) or _sized(right)):
        seq, n = (left, right) if _sized(left) else (right, left)
        if isinstance(n, int):
            budget.check(_weight(seq, budget.cap) * max(n, 0), "a repeated sequence")
    elif op == "**" and isinstance(left, int) and isinstance(right, int):
        if right > 0 and abs(left) > 1 and right * left.bit_length() > budget.bits:
            raise TemplateLimitExceeded("an integer power exceeds the "
                                        "template limit")
    elif op == "+" and _sized(left) and _sized(right):
        budget.check(_weight(left, budget.cap) + _weight(right, budget.cap),
                     "a concatenation")
    elif op == "%" and isinstance(left, str):
        budget.check_format(left, right if isinstance(right, tuple) else (right,))


def _check_call(budget: _Budget, obj, args: tuple, kwargs: dict) -> tuple:
    """A call the template makes: string methods that allocate by an argument are
    checked; the arguments to pass on (an iterable given to `join` is listed once,
    so it is the very list that was measured)."""
    target = getattr(obj, "__wrapped__", obj)
    owner = getattr(target, "__self__", None)
    if not isinstance(owner, str):
        return args
    name = getattr(target, "__name__", "")
    values = (*args, *kwargs.values())
    if name in ("center", "ljust", "rjust", "zfill", "expandtabs"):
        budget.check(max([a for a in values if isinstance(a, int)], default=0),
                     f"str.{name}")
    elif name in ("format", "format_map"):
        budget.check_format(owner, values)
    elif name == "replace" and len(args) >= 2:
        old, new = str(args[0]), str(args[1])
        n = owner.count(old) if old else len(owner) + 1
        budget.check(len(owner) + max(len(new) - len(old), 0) * n, "str.replace")
    elif name == "join" and args:
        items = list(args[0])
        budget.check(len(owner) * len(items) + _weight(items, budget.cap),
                     "str.join")
        args = (items, *args[1:])
    return args


def _check_filter(budget: _Budget, name: str, skip: int, args: tuple,
                  kwargs: dict) -> tuple:
    """A filter call (`skip`: 2 if its first argument is the context, else 1): integer
    arguments, and the text a text filter would make; the arguments to pass on."""
    for a in (*args[skip:], *kwargs.values()):
        if isinstance(a, int) and abs(a) > budget.cap:
            raise TemplateLimitExceeded(f"the argument {a} of the filter "
                                        f"{name!r} exceeds the template limit")
    if name in _TEXT_FILTERS and len(args) >= skip:
        args = _check_text_filter(budget, name, skip, args, kwargs)
    if name == "sum":
        budget.check(_weight((*args[skip - 1:], *kwargs.values()), budget.cap),
                     "the filter 'sum'")
    return args


def _check_text_filter(budget: _Budget, name: str, skip: int, args: tuple,
                       kwargs: dict) -> tuple:
    """The printed size of a text filter's input and arguments, the arguments
    counted once per place they are inserted (`join`, `replace`, `indent`,
    `wordwrap`)."""
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
    return args


# --- the sandboxed environment ------------------------------------------------------

@functools.lru_cache(maxsize=1)
def _sandbox_class():
    """Jinja's immutable sandbox with the operator and call checks above (made on
    first use: Jinja is imported then)."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class BoundedSandbox(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "**", "+", "%"})

        def __init__(self, budget: _Budget, **options):
            super().__init__(**options)
            self._budget = budget         # a name a template cannot reach (`_`)

        def call_binop(self, context, op, left, right):
            _check_binop(self._budget, op, left, right)
            return super().call_binop(context, op, left, right)

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805
            args = _check_call(__self._budget, __obj, args, kwargs)
            return super().call(__context, __obj, *args, **kwargs)

    return BoundedSandbox


def _finalize(budget: _Budget, value):
    """Every {{ ... }} passes here before it becomes text."""
    budget.check_value(value, "an output value")
    return value


def _bounded_filter(budget: _Budget, name: str, f):
    skip = 2 if getattr(f, "jinja_pass_arg", None) else 1  # [context,] value

    @functools.wraps(f)          # keeps Jinja's pass-context marker
    def wrapper(*args, **kwargs):
        return f(*_check_filter(budget, name, skip, args, kwargs), **kwargs)
    return wrapper


def _tojson(value, indent=None):
    # Hugging Face's version (templates are written for it): no HTML escaping.
    return json.dumps(value, ensure_ascii=False, indent=indent)


def _raise_exception(message):
    raise _TemplateRaised(str(message))


def _strftime_now(fmt):
    return time.strftime(str(fmt))


def _make_environment(budget: _Budget):
    """An immutable Jinja sandbox whose operators, method calls, filters, `~`
    and output check sizes *before* they allocate."""
    env = _sandbox_class()(budget, trim_blocks=True, lstrip_blocks=True,
                           finalize=functools.partial(_finalize, budget),
                           extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.filters.update({n: _bounded_filter(budget, n, f)
                        for n, f in env.filters.items()})
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
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


# --- which tokens end a turn --------------------------------------------------------

# Markers that end a turn in the formats we know, as llama.cpp's end-of-generation
# set spells them; each one the vocabulary holds as a single special token stops.
END_MARKERS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>",
               "<|endoftext|>", "<|eom_id|>")


def single_special(tokenizer, text: str) -> int | None:
    """The id of `text` if the vocabulary holds it as one special token."""
    raw = text.encode("utf-8")
    for marker, tid, _ in tokenizer.special_markers:
        if marker == raw:
            return tid
    return None


def end_of_turn_ids(tokenizer) -> frozenset[int]:
    """The ids a chat answer stops on: the tokenizer's end-of-turn ids and every
    `END_MARKERS` entry the vocabulary holds as one token (chat.ChatFormat, and the
    grammars, which let an answer end only there)."""
    stops = set(tokenizer.eot_ids)
    for marker in END_MARKERS:
        tid = single_special(tokenizer, marker)
        if tid is not None:
            stops.add(tid)
    return frozenset(stops)
