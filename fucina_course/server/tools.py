"""Tool calling on /v1/chat/completions, OpenAI's shape over tool_calls.py.

The request: `tools` (functions, each with a JSON schema), `tool_choice` ("auto",
"none", "required" or a named function), `parallel_tool_calls`; the history may hold
assistant messages with `tool_calls` and `tool` messages with the results
(messages.chat_messages).  `ToolPlan` turns them into what the engine needs: the
entries the chat template renders and a grammar processor for the sampler (lazy for
"auto", from the first token for "required" or a named function).  "none" renders
no tools at all, so the model is not offered any and never calls one.

The answer: the model's `<tool_call>` blocks become `message.tool_calls` (each with
an id, `"type": "function"`, the name and the arguments as JSON text) and
`finish_reason` "tool_calls"; the text around them stays `content` (None when
there is none).  Streamed, the chat stream's content deltas pass through a
`ToolCallStream`: a call's first delta carries its index, id, type and name, the
next ones fragments of its arguments, which join to the same text as the whole
answer's.  The rewrite sits on top of answers.py's chat bodies (`tool_message`,
`tool_events`), which know nothing of tools.

Decisions where the API leaves room: one call per answer unless
`parallel_tool_calls` is true (llama.cpp's default; OpenAI's is true, but a small
model offered a second call greedily repeats the first with other arguments, seen
on the default model); `response_format` together with tools (other
than "none") is a 400, since the two grammars would fight over the same answer;
an answer cut by max_tokens inside a call keeps the partial arguments and says
"length", as OpenAI's do.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import AsyncIterable

from ..tool_calls import (ToolCallStream, ToolError, choice_of, open_id, parse_tool_calls,
                          tool_grammar, tools_of)
from .schema import ApiError


@dataclass
class ToolPlan:
    """A request's tools, ready: `entries` for the template; `processor()` for the
    sampler (None: the answer is free)."""

    entries: list[dict]
    mode: str
    factory: object
    after: int | None
    choice: object = "auto"          # as the request spelled it (echoed by responses)
    parallel: bool = False

    def processor(self, think_close: int | None = None):
        """`think_close`: the `</think>` id when the rendered prompt left the model
        inside a think block: a required call then starts after it."""
        return self.factory.processor(after=self.after if self.after is not None
                                      else think_close)


def plan(req, tokenizer) -> ToolPlan | None:
    """(A worker thread.)  The request's tools, or None when it has none (or
    tool_choice "none")."""
    if not req.tools:                            # None or [] (clients send both)
        if req.tool_choice not in (None, "none", "auto"):
            raise ApiError(400, "tool_choice needs tools", param="tool_choice")
        return None
    try:
        tools = tools_of(req.tools)
        mode, names = choice_of(req.tool_choice, tools)
        if mode == "none":
            return None
        if req.response_format is not None and \
                req.response_format.get("type") != "text":
            raise ToolError("response_format cannot be combined with tools (both "
                            "would constrain the same answer)", "response_format")
        lazy = mode == "auto"
        parallel = req.parallel_tool_calls is True
        factory = tool_grammar(tools, names, tokenizer, lazy=lazy, parallel=parallel)
        after = open_id(tokenizer) if lazy else None
    except ToolError as e:
        raise ApiError(400, str(e), param=e.param, code="invalid_tools") from None
    return ToolPlan([t.template_entry() for t in tools], mode, factory, after,
                    req.tool_choice or "auto", parallel)


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_message(completion: dict) -> dict:
    """A `chat.completion` body with its calls parsed out of the content."""
    choice = completion["choices"][0]
    message = choice["message"]
    content, calls = parse_tool_calls(message.get("content") or "")
    if not calls:
        return completion
    message["content"] = content or None
    message["tool_calls"] = [
        {"id": _call_id(), "type": "function",
         "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
    if choice["finish_reason"] == "stop":
        choice["finish_reason"] = "tool_calls"
    return completion


async def tool_events(events: AsyncIterable[dict]):
    """The chat stream with its content deltas turned into content and tool_calls
    deltas, and "tool_calls" as the finish reason when a call was made."""
    stream, called = ToolCallStream(), False
    async for event in events:
        data = event.get("data")
        body = json.loads(data) if data and data.startswith("{") else None
        choices = body.get("choices") if body else None
        if not choices or "delta" not in choices[0]:
            yield event
            continue
        delta, finish = choices[0]["delta"], choices[0]["finish_reason"]
        pieces = stream.push(delta.pop("content")) if "content" in delta and \
            "role" not in delta else []
        if finish is not None:
            pieces += stream.finish()
        for kind, *rest in pieces:
            called |= kind == "call"
            yield _delta(body, _piece(kind, rest))
        if finish is not None:
            if called and finish == "stop":
                choices[0]["finish_reason"] = "tool_calls"
            yield {"data": json.dumps(body)}
        elif delta or "role" in choices[0]["delta"]:
            yield {"data": json.dumps(body)}


def _piece(kind: str, rest: list) -> dict:
    if kind == "content":
        return {"content": rest[0]}
    index, value = rest
    if kind == "call":
        return {"tool_calls": [{"index": index, "id": _call_id(), "type": "function",
                                "function": {"name": value, "arguments": ""}}]}
    return {"tool_calls": [{"index": index, "function": {"arguments": value}}]}


def _delta(body: dict, delta: dict) -> dict:
    """`body` (a chunk) carrying `delta` instead of its own, unfinished."""
    choice = {**body["choices"][0], "delta": delta, "finish_reason": None}
    return {"data": json.dumps({**body, "choices": [choice]})}


# --- /v1/responses: function_call items ---------------------------------------------

def _call_item(name: str, arguments: str, status: str) -> dict:
    return {"type": "function_call", "id": f"fc_{uuid.uuid4().hex[:24]}",
            "call_id": _call_id(), "name": name, "arguments": arguments,
            "status": status}


def _with_calls(obj: dict, content: str, calls: list[dict], plan_: ToolPlan) -> dict:
    """A finished response object whose message holds `content` (dropped when
    empty), followed by the `function_call` items `calls`."""
    output = []
    for item in obj["output"]:
        if item["type"] != "message":
            continue
        if content or not calls:
            if item["content"]:
                item["content"][0]["text"] = content
            output.append(item)
        output += calls
    obj["output"] = output + [i for i in obj["output"] if i["type"] != "message"]
    obj["tools"] = [_flat(e) for e in plan_.entries]
    obj["tool_choice"] = plan_.choice
    obj["parallel_tool_calls"] = plan_.parallel
    return obj


def _flat(entry: dict) -> dict:
    """A tool as the Responses API spells it (no `function` wrapper)."""
    return {"type": "function", "strict": None, "description": None,
            **entry["function"]}


def tool_response(obj: dict, plan_: ToolPlan) -> dict:
    """A finished `response` object with its calls parsed out of the message."""
    message = next((i for i in obj["output"] if i["type"] == "message"), None)
    text = message["content"][0]["text"] if message and message["content"] else ""
    content, calls = parse_tool_calls(text)
    status = "completed" if obj["status"] == "completed" else "incomplete"
    items = [_call_item(c.name, c.arguments, status) for c in calls]
    return _with_calls(obj, content if calls else text, items, plan_)


class ResponseToolEvents:
    """The Responses stream of a request with tools: the message's text deltas
    through a `ToolCallStream`; the message item is opened only when text that is
    not blank arrives, and each call is an item of its own (`output_item.added`,
    `function_call_arguments.delta`, `.done`, `output_item.done`).  Events are
    numbered again, in the order sent."""

    def __init__(self, plan_: ToolPlan):
        self.plan, self.stream, self.seq = plan_, ToolCallStream(), 0
        self.message: dict | None = None     # the message item, once opened
        self.msg_id, self.msg_index = None, 0
        self.text, self.blank = "", ""       # its text; blank text not yet sent
        self.calls: list[dict] = []
        self.index = 0                       # the next output_index

    def event(self, kind: str, **body) -> dict:
        body = {"type": kind, "sequence_number": self.seq, **body}
        self.seq += 1
        return {"event": kind, "data": json.dumps(body)}

    async def run(self, events: AsyncIterable[dict]):
        async for ev in events:
            body = json.loads(ev["data"])
            kind = body.pop("type")
            body.pop("sequence_number", None)
            if kind == "response.output_text.delta":
                for out in self.pieces(self.stream.push(body["delta"])):
                    yield out
            elif kind == "response.output_text.done":
                for out in self.pieces(self.stream.finish()):
                    yield out
            elif kind in ("response.completed", "response.incomplete"):
                for out in self.close(body["response"]):
                    yield out
            elif kind.startswith("response.output_item") or \
                    kind.startswith("response.content_part"):
                self.msg_id = body.get("item_id") or body.get("item", {}).get("id")
            else:                            # created, in_progress, error
                yield self.event(kind, **body)

    def pieces(self, pieces: list[tuple]):
        for kind, *rest in pieces:
            if kind == "content":
                yield from self.content(rest[0])
            elif kind == "call":
                self.blank = ""
                item = _call_item(rest[1], "", "in_progress")
                self.calls.append({"item": item, "index": self.index})
                self.index += 1
                yield self.event("response.output_item.added",
                                 output_index=self.calls[-1]["index"], item=item)
            else:
                call = self.calls[rest[0]]
                call["item"]["arguments"] += rest[1]
                yield self.event("response.function_call_arguments.delta",
                                 item_id=call["item"]["id"],
                                 output_index=call["index"], delta=rest[1])

    def content(self, text: str):
        if self.message is None:
            if not (self.blank + text).strip():
                self.blank += text
                return
            text, self.blank = self.blank + text, ""
            self.message = {"type": "message", "id": self.msg_id,
                            "status": "in_progress", "role": "assistant", "content": []}
            self.msg_index, self.index = self.index, self.index + 1
            yield self.event("response.output_item.added",
                             output_index=self.msg_index, item=self.message)
            yield self.event("response.content_part.added", **self.where(),
                             part={"type": "output_text", "text": "", "annotations": []})
        self.text += text
        yield self.event("response.output_text.delta", **self.where(), delta=text,
                         logprobs=[])

    def where(self) -> dict:
        return dict(item_id=self.msg_id, output_index=self.msg_index, content_index=0)

    def close(self, response: dict):
        """The items' ends, then the finished response made of them."""
        status = "completed" if response["status"] == "completed" else "incomplete"
        text = self.text.strip() if self.calls else self.text
        final = _with_calls(response, text, [c["item"] for c in self.calls], self.plan)
        if self.message is not None:
            part = {"type": "output_text", "text": text, "annotations": []}
            yield self.event("response.output_text.done", **self.where(), text=text,
                             logprobs=[])
            yield self.event("response.content_part.done", **self.where(), part=part)
            item = next(i for i in final["output"] if i["type"] == "message")
            yield self.event("response.output_item.done",
                             output_index=self.msg_index, item=item)
        for call in self.calls:
            item = call["item"]
            item["status"] = status
            yield self.event("response.function_call_arguments.done",
                             item_id=item["id"], output_index=call["index"],
                             arguments=item["arguments"])
            yield self.event("response.output_item.done", output_index=call["index"],
                             item=item)
        yield self.event("response.completed" if status == "completed"
                         else "response.incomplete", response=final)
