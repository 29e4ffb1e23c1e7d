"""A request's messages -> the chat template's: the chat route's `messages` and the
Responses route's `instructions` and `input` items, in the one shape the template
reads ({"role", "content"}, an assistant's `tool_calls`, a tool result's
`tool_call_id`).  One content rule for both routes (`text_of`): a string, or text
parts joined; anything else (images, audio) is a 400 naming the part.

Tool history: an assistant's calls keep their ids; their arguments, JSON text on
the wire, become objects (tool_calls.history_message), as Qwen's template writes
them with `tojson`.  A `tool` message (a `function_call_output` item) must follow
the calls it answers, as OpenAI requires.
"""

from __future__ import annotations

from ..tool_calls import history_message
from .schema import (USE_TOOLS, ApiError, Message, ResponsesRequest, Rule, is_neutral,
                     unsupported)


def text_of(content, where: str) -> str:
    """A message's content: a string, or text parts joined.  The parts are the chat
    schema's models or the Responses API's plain dicts: one rule for both."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(400, "content must be a string or a list of text parts",
                       param=f"{where}.content")
    out = []
    for i, part in enumerate(content):
        get = part.get if isinstance(part, dict) else lambda k, p=part: getattr(p, k, None)
        kind, text = get("type"), get("text")
        if kind not in ("text", "input_text", "output_text") or not isinstance(text, str):
            raise ApiError(400, f"only text content is supported, got a {kind!r} part",
                           param=f"{where}.content[{i}]")
        out.append(text)
    return "".join(out)


ROLES = {"system": "system", "developer": "system", "user": "user",
         "assistant": "assistant"}


def chat_messages(items: list[Message]) -> list[dict]:
    """The chat route's messages -> the template's dicts: {"role", "content"}, an
    assistant's `tool_calls` (arguments as objects: tool_calls.history_message),
    a tool result's `tool_call_id`."""
    messages = []
    for i, m in enumerate(items):
        role = "tool" if m.role == "tool" else ROLES.get(m.role)
        if role is None:
            raise ApiError(400, f"unsupported role {m.role!r} (use system, user, "
                           f"assistant or tool)", param=f"messages[{i}].role")
        for name in ("function_call", "audio"):
            if getattr(m, name) not in (None, []):
                raise unsupported(f"messages[{i}].{name}", Rule(
                    "refused", why=USE_TOOLS if name != "audio"
                    else "text output only"))
        message = {"role": role, "content": text_of(m.content, f"messages[{i}]")}
        if m.tool_calls:
            if role != "assistant":
                raise ApiError(400, "only an assistant message holds tool_calls",
                               param=f"messages[{i}].tool_calls")
            message["tool_calls"] = _tool_calls(m.tool_calls, f"messages[{i}]")
        if role == "tool":
            if not messages or not (messages[-1]["role"] == "tool"
                                    or messages[-1].get("tool_calls")):
                raise ApiError(400, "a tool message must answer an assistant "
                               "message's tool_calls", param=f"messages[{i}].role")
            message["tool_call_id"] = m.tool_call_id or ""
        messages.append(history_message(message))
    return messages


def _tool_calls(calls: list, where: str) -> list[dict]:
    """An assistant's calls in the history: each `{"id", "type": "function",
    "function": {"name", "arguments"}}`, checked enough to render."""
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) \
                or not isinstance(fn.get("arguments", ""), (str, dict)):
            raise ApiError(400, "a tool call is {\"type\": \"function\", \"function\": "
                           "{\"name\": str, \"arguments\": str}}",
                           param=f"{where}.tool_calls[{j}]")
    return list(calls)


def response_messages(req: ResponsesRequest) -> list[dict]:
    """The Responses route's instructions and input -> the template's messages."""
    if req.text is not None and not is_neutral(req.text.verbosity, (None, "medium")):
        raise unsupported("text.verbosity", Rule("refused", why="no verbosity control"))
    messages = [{"role": "system", "content": req.instructions}] \
        if req.instructions else []
    if isinstance(req.input, str):
        messages.append({"role": "user", "content": req.input})
    else:
        for i, item in enumerate(req.input):
            kind = item.get("type", "message")
            if kind == "function_call":
                _add_call(messages, item, f"input[{i}]")
            elif kind == "function_call_output":
                messages.append(_call_output(messages, item, f"input[{i}]"))
            else:
                messages.append(_response_item(item, f"input[{i}]"))
    if not any(m["role"] != "system" for m in messages):
        raise ApiError(400, "input must hold at least one message", param="input")
    return [history_message(m) for m in messages]


def _add_call(messages: list[dict], item: dict, where: str) -> None:
    """A `function_call` input item: a call in the assistant turn before it (one
    is opened if the last message is not the assistant's)."""
    for name in ("call_id", "name", "arguments"):
        if not isinstance(item.get(name), str):
            raise ApiError(400, f"a function_call item needs a string {name}",
                           param=f"{where}.{name}")
    call = {"id": item["call_id"], "type": "function",
            "function": {"name": item["name"], "arguments": item["arguments"]}}
    if not messages or messages[-1]["role"] != "assistant":
        messages.append({"role": "assistant", "content": ""})
    messages[-1].setdefault("tool_calls", []).append(call)


def _call_output(messages: list[dict], item: dict, where: str) -> dict:
    """A `function_call_output` input item: the result of a call before it."""
    if not messages or not (messages[-1]["role"] == "tool"
                            or messages[-1].get("tool_calls")):
        raise ApiError(400, "a function_call_output must follow its function_call",
                       param=f"{where}.type")
    if not isinstance(item.get("call_id"), str):
        raise ApiError(400, "a function_call_output item needs a string call_id",
                       param=f"{where}.call_id")
    output = item.get("output")
    if not isinstance(output, (str, list)):
        raise ApiError(400, "output must be a string or a list of text parts",
                       param=f"{where}.output")
    return {"role": "tool", "tool_call_id": item["call_id"],
            "content": text_of(output, where)}


def _response_item(item: dict, where: str) -> dict:
    if item.get("type", "message") != "message":
        raise ApiError(400, f"only message, function_call and function_call_output "
                       f"items are supported, got "
                       f"{item.get('type')!r}", param=f"{where}.type")
    role = ROLES.get(item.get("role"))
    if role is None:
        raise ApiError(400, f"unsupported role {item.get('role')!r}",
                       param=f"{where}.role")
    if item.get("content") is None:
        raise ApiError(400, "content must be a string or a list of text parts",
                       param=f"{where}.content")
    return {"role": role, "content": text_of(item["content"], where)}
