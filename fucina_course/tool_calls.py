"""Tool calls: a model asks the caller to run a function, in a format it was taught.

The model is told which functions exist by its chat template, which renders OpenAI's
`tools` list into the system turn (Qwen2.5's and Qwen3's templates do: "You may call
one or more functions... within <tools></tools> XML tags"), and it calls one by
writing, in place of an answer,

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

`<tool_call>` and `</tool_call>` are single special tokens of Qwen's vocabulary.  The
caller runs the function and sends the result back as a `tool` message, which the
template renders inside `<tool_response>` in a user turn; the model answers from it.

Three things here:
* `tools_of` / `choice_of`: OpenAI's `tools` and `tool_choice`, checked, with the
  reason when they are wrong;
* `tool_grammar`: a grammar (grammar.py, llguidance) that only lets a call through
  to an allowed function whose arguments validate against its JSON schema.  With
  `tool_choice` "required" or a named function it holds from the first token of the
  answer; with "auto" it is lazy, as llama.cpp's is: the answer is free prose until
  the model opens `<tool_call>`, and from that token on the grammar holds
  (`Factory.processor(after=...)`), so a call never comes out malformed;
* `ToolCallStream` / `parse_tool_calls`: the answer's text -> content and calls, as
  it streams (the name as soon as it is known, then the arguments in fragments) or
  whole.  The whole parse *is* the stream, folded, so the two always agree.

Rejected: parsing calls out of free text without a grammar (what a template alone
gives): a 0.5B model's JSON is then sometimes broken, and a client's agent loop
breaks with it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Sequence

from .errors import FucinaError
from .text_stream import held_back

TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")          # OpenAI's rule for a name
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')
_JSON = json.JSONDecoder()
_TAIL = re.compile(r"[\s}]*\Z")                       # may close the call, not its args
MAX_TOOLS = 128                                         # OpenAI's limit


class ToolError(FucinaError, ValueError):
    """`tools` or `tool_choice` is not what the API allows; `param` names it."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Tool:
    """One function the model may call: its JSON schema is `parameters`."""

    name: str
    description: str | None
    parameters: dict

    def template_entry(self) -> dict:
        """The entry the chat template renders (OpenAI's chat shape)."""
        function = {"name": self.name, "parameters": self.parameters}
        if self.description:
            function["description"] = self.description
        return {"type": "function", "function": function}


def tools_of(spec, param: str = "tools") -> list[Tool]:
    """OpenAI's `tools`, chat shape (`{"type": "function", "function": {...}}`) or
    Responses shape (`{"type": "function", "name": ...}`), checked."""
    if not isinstance(spec, list) or not spec:
        raise ToolError("tools must be a non-empty list of functions", param)
    if len(spec) > MAX_TOOLS:
        raise ToolError(f"at most {MAX_TOOLS} tools, got {len(spec)}", param)
    tools, seen = [], set()
    for i, item in enumerate(spec):
        where = f"{param}[{i}]"
        if not isinstance(item, dict) or item.get("type") != "function":
            raise ToolError("each tool must be {\"type\": \"function\", ...} "
                            "(only function tools exist here)", f"{where}.type")
        fn = item.get("function", item)
        if not isinstance(fn, dict):
            raise ToolError("function must be an object", f"{where}.function")
        name, desc = fn.get("name"), fn.get("description")
        if not isinstance(name, str) or not _NAME.match(name):
            raise ToolError("a function name is 1-64 letters, digits, _ or -, got "
                            f"{name!r}", f"{where}.function.name")
        if name in seen:
            raise ToolError(f"function {name!r} is listed twice", f"{where}.function.name")
        if desc is not None and not isinstance(desc, str):
            raise ToolError("description must be a string", f"{where}.function.description")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise ToolError("parameters must be a JSON schema object",
                            f"{where}.function.parameters")
        seen.add(name)
        tools.append(Tool(name, desc, params))
    return tools


def choice_of(choice, tools: Sequence[Tool], param: str = "tool_choice") -> tuple:
    """`tool_choice` -> (mode, names): mode "none", "auto" or "required"; names the
    functions the answer may call (one, for a named function)."""
    names = [t.name for t in tools]
    if choice is None or choice in ("auto", "none", "required"):
        return (choice or "auto"), names
    if isinstance(choice, dict) and choice.get("type") == "function":
        fn = choice.get("function", choice)
        name = fn.get("name") if isinstance(fn, dict) else None
        if name not in names:
            raise ToolError(f"tool_choice names {name!r}, which is not among the "
                            f"tools ({', '.join(names)})", f"{param}.function.name")
        return "required", [name]
    raise ToolError("tool_choice must be 'none', 'auto', 'required' or "
                    "{\"type\": \"function\", \"function\": {\"name\": ...}}", param)


def tool_grammar(tools: Sequence[Tool], names: Sequence[str], tokenizer, *,
                 lazy: bool, parallel: bool = True):
    """A grammar.Factory for calls to `names` (`tool_lark`); `lazy`: use it with
    `processor(after=open_id(tokenizer))`."""
    from . import grammar        # llguidance: optional, like the server's other grammars

    source = tool_lark(tools, names, tokenizer, lazy=lazy, parallel=parallel)
    try:
        return grammar.Factory(grammar.lark(source), tokenizer,
                               description="tools' parameters")
    except grammar.GrammarError as e:
        raise ToolError(str(e), "tools") from None


def tool_lark(tools: Sequence[Tool], names: Sequence[str], tokenizer, *,
              lazy: bool, parallel: bool = True) -> str:
    """The grammar of calls to `names`, in llguidance's Lark dialect: each
    `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` (the two tags
    are single tokens, `<[id]>`), the arguments valid for that function's schema
    (`%json`); one call, or several separated by a newline when `parallel`.
    `lazy`: the grammar starts after the model's own `<tool_call>`, else it holds
    from the first token of the answer."""
    from .grammar import WHITESPACE_PATTERN

    by_name = {t.name: t for t in tools}
    body = {"anyOf": [{
        "type": "object",
        "properties": {"name": {"const": n}, "arguments": by_name[n].parameters},
        "required": ["name", "arguments"], "additionalProperties": False}
        for n in names], "x-guidance": {"whitespace_pattern": WHITESPACE_PATTERN}}
    o, c = (f"<[{_special(tokenizer, t)}]>" for t in (TOOL_OPEN, TOOL_CLOSE))
    call = f'{o} "\\n" body "\\n" {c}'
    rest = f' ("\\n" {call})*' if parallel else ""
    first = f'"\\n" body "\\n" {c}' if lazy else call
    return f"start: {first}{rest}\nbody: %json {json.dumps(body)}\n"


def open_id(tokenizer) -> int:
    """The id of `<tool_call>`: where a lazy tool grammar starts."""
    return _special(tokenizer, TOOL_OPEN)


def _special(tokenizer, text: str) -> int:
    ids = tokenizer.encode_raw(text)
    if len(ids) != 1:
        raise ToolError(f"this model's vocabulary has no {text} token: it was not "
                        "taught to call tools", "tools")
    return ids[0]


class ToolUse:
    """A conversation's tools (chat.Conversation(tools=...)): the entries its
    template renders and, for each answer, a fresh grammar processor (lazy for
    "auto"; none at all for "none", which offers no tools).  One call per answer.
    "required" and a named function hold for the answer to a user's message; the
    answer to tool results is "auto" (else the model could only call again)."""

    def __init__(self, tools, choice, tokenizer):
        self.tools = tools_of(tools)
        self.mode, names = choice_of(choice, self.tools)
        self.tokenizer = tokenizer
        offered = self.mode != "none"
        self.entries = [t.template_entry() for t in self.tools] if offered else None
        self.factory = tool_grammar(self.tools, names, tokenizer, lazy=self.mode == "auto",
                                    parallel=False) if offered else None
        self._auto = self.factory if self.mode == "auto" else None

    def processor(self, follow_up: bool = False):
        """A fresh processor for one answer (`follow_up`: the answer to results)."""
        if self.factory is None:
            return None
        if self.mode == "auto" or follow_up:
            if self._auto is None:
                self._auto = tool_grammar(self.tools, [t.name for t in self.tools],
                                          self.tokenizer, lazy=True, parallel=False)
            return self._auto.processor(after=open_id(self.tokenizer))
        return self.factory.processor()


# --- the answer's text -> content and calls -----------------------------------------

@dataclass
class ToolCall:
    name: str
    arguments: str                  # the model's JSON text of the arguments


class ToolCallStream:
    """Text pieces in; events out: ("content", text), ("call", index, name),
    ("arguments", index, fragment).  The fragments of a call join to its
    arguments' JSON text exactly as the model wrote it.

    Held back: a tail that could begin `<tool_call>` (it may be one), and in a call,
    a tail that could begin `</tool_call>`, and before it a tail of `}` and
    whitespace (it may close the call's object, not the arguments).  An unterminated call (the answer hit its limit) keeps what it has."""

    def __init__(self):
        self.buf, self.in_call, self.calls = "", False, 0
        self._named = False
        self._sent = 0                      # argument characters already sent

    def push(self, text: str) -> list[tuple]:
        self.buf += text
        events: list[tuple] = []
        while True:
            if not self.in_call:
                at = self.buf.find(TOOL_OPEN)
                if at < 0:
                    keep = held_back(self.buf, len(self.buf), (TOOL_OPEN,))
                    self._content(events, self.buf[:len(self.buf) - keep])
                    self.buf = self.buf[len(self.buf) - keep:]
                    return events
                self._content(events, self.buf[:at])
                self.buf, self.in_call = self.buf[at + len(TOOL_OPEN):], True
                self._named, self._sent = False, 0
            end = self.buf.find(TOOL_CLOSE)
            body = self.buf if end < 0 else self.buf[:end]
            self._call(events, body, done=end >= 0)
            if end < 0:
                return events
            self.buf, self.in_call = self.buf[end + len(TOOL_CLOSE):], False
            self.calls += 1

    def finish(self) -> list[tuple]:
        events: list[tuple] = []
        if self.in_call:
            self._call(events, self.buf, done=True)
            self.calls += 1
        else:
            self._content(events, self.buf)
        self.buf, self.in_call = "", False
        return events

    def _content(self, events: list, text: str) -> None:
        if text and not (self.calls and not text.strip()):   # newlines between calls
            events.append(("content", text))

    def _call(self, events: list, body: str, done: bool) -> None:
        head = _HEAD.match(body)
        if head is None:
            return
        start = head.end()
        if not self._named:
            events.append(("call", self.calls, json.loads(f'"{head.group(1)}"')))
            self._named = True
        if done:
            try:
                end = _JSON.raw_decode(body, start)[1]
            except ValueError:              # unterminated: all of it, as written
                end = len(body.rstrip())
            upto = end
        else:
            seen = len(body) - held_back(body, len(body), (TOOL_CLOSE,))
            upto = max(_TAIL.search(body[:seen], start).start(), start)
        if upto > start + self._sent:
            events.append(("arguments", self.calls, body[start + self._sent:upto]))
            self._sent = upto - start


def parse_tool_calls(text: str) -> tuple[str, list[ToolCall]]:
    """A whole answer -> (its content, its calls): the stream's events, folded."""
    stream, content, calls = ToolCallStream(), [], []
    for event in stream.push(text) + stream.finish():
        if event[0] == "content":
            content.append(event[1])
        elif event[0] == "call":
            calls.append(ToolCall(event[2], ""))
        else:
            calls[event[1]].arguments += event[2]
    return "".join(content).strip() if calls else "".join(content), calls


def history_message(message: dict) -> dict:
    """An OpenAI history message as the template expects it: an assistant's
    `tool_calls` arguments as objects (OpenAI sends them as JSON text; Qwen's
    template writes them with `tojson`), so the model sees its own calls again."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    out = []
    for call in calls:
        fn = dict(call.get("function", call))
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                fn["arguments"] = json.loads(args)
            except ValueError:
                pass                         # not JSON: rendered as the text it is
        out.append({**call, "function": fn})
    return {**message, "tool_calls": out}
