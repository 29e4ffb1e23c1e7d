"""What the client is told: OpenAI's response objects and stream events, built from
the engine's `Reply` and from a job's events.  Pure: the builders take a reply (or
an async iterable of the job's ("text" | "done" | "error", payload) events) and
return plain dicts, so they are tested by calling them, without HTTP
(tests/test_server.py checks them against the `openai` client's own types).

The bodies are dicts in the exact key order the API documents, not pydantic
models: a stream sends one per token, and some keys are present or absent by the
request (`usage: null` in every chunk only when `stream_options.include_usage`
asked for the final usage chunk), which a model would spell as exclusion rules.

Stream events are sse-starlette's event dicts (`{"data": ...}`, `{"event": ...,
"data": ...}`): the response (stream.py) frames them, one `data:` line each (the
JSON has no raw newline), then a blank line; chat and completions end with
`data: [DONE]`, as OpenAI's do.

Qwen3 thinking: the think block goes to `reasoning_content` (a "reasoning" item on
/v1/responses), never into `content` (`ThinkSplitter`, also while streaming, so
half a tag is never shown).  Token counts are real: `usage`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, AsyncIterable

from ..text_stream import ThinkSplitter
from .schema import error_of

DONE = {"data": "[DONE]"}


def sse(body: dict) -> dict:
    """One server-sent event carrying `body`: `data: {json}`."""
    return {"data": json.dumps(body)}


def finish_reason(reply) -> str:
    """The engine's stop reason -> OpenAI's: the end marker or a stop string is
    "stop"; max_tokens or a full context is "length"."""
    return "stop" if reply.stop_reason in ("end", "stop_string") else "length"


def usage(reply, n_prompt: int) -> dict:
    """Real token counts.  completion_tokens: every token the sampler chose, the
    end marker or the token that completed a stop string included (it was
    generated, though not shown); prompt_tokens: the whole prompt, of which
    `cached_tokens` were found in the slot's cache (prefix reuse) and not
    prefilled again."""
    sampled = len(reply.ids) + (reply.stop_reason in ("end", "stop_string"))
    return {"prompt_tokens": n_prompt, "completion_tokens": sampled,
            "total_tokens": n_prompt + sampled,
            "prompt_tokens_details": {"cached_tokens": reply.reused},
            "completion_tokens_details": {"reasoning_tokens": 0}}


def split_think(raw: str, split: bool, thinking: bool) -> tuple[str, str]:
    """A whole answer -> (reasoning, content); `split`: the format can think;
    `thinking`: the template opened the block the answer continues."""
    if not split:
        return "", raw
    splitter = ThinkSplitter(thinking)
    r1, c1 = splitter.push(raw)
    r2, c2 = splitter.finish()
    return r1 + r2, c1 + c2


# --- /v1/chat/completions -----------------------------------------------------------

def chat_completion(meta: dict, reply, n_prompt: int, split: bool,
                    thinking: bool) -> dict:
    """The `chat.completion` object.  `meta`: id, created, model."""
    reasoning, content = split_think(reply.raw_text, split, thinking)
    message = {"role": "assistant", "content": content}
    if reasoning:
        message["reasoning_content"] = reasoning
    return {**meta, "object": "chat.completion", "system_fingerprint": None,
            "choices": [{"index": 0, "message": message, "logprobs": None,
                         "finish_reason": finish_reason(reply)}],
            "usage": usage(reply, n_prompt)}


def chat_chunk(meta: dict, delta: dict, finish: str | None = None, *,
               include_usage: bool = False) -> dict:
    body = {**meta, "object": "chat.completion.chunk", "system_fingerprint": None,
            "choices": [{"index": 0, "delta": delta, "logprobs": None,
                         "finish_reason": finish}]}
    if include_usage:
        body["usage"] = None
    return body


def chat_usage_chunk(meta: dict, reply, n_prompt: int) -> dict:
    """The last chunk when `stream_options.include_usage`: no choices, the usage."""
    return {**meta, "object": "chat.completion.chunk", "system_fingerprint": None,
            "choices": [], "usage": usage(reply, n_prompt)}


async def chat_events(events: AsyncIterable, meta: dict, n_prompt: int, *,
                      split: bool, thinking: bool, include_usage: bool):
    """A job's events -> the chat stream: the role, the deltas (reasoning and
    content apart), the finish reason, the usage if asked, [DONE]; or an error
    body, after which the stream ends."""
    def chunk(delta, finish=None):
        return sse(chat_chunk(meta, delta, finish, include_usage=include_usage))

    splitter = ThinkSplitter(thinking) if split else None
    yield chunk({"role": "assistant", "content": ""})
    async for kind, payload in events:
        if kind == "text":
            reasoning, content = splitter.push(payload) if splitter else ("", payload)
        elif kind == "done":
            reasoning, content = splitter.finish() if splitter else ("", "")
        else:
            yield sse(error_of(payload).body())
            return
        if reasoning:
            yield chunk({"reasoning_content": reasoning})
        if content:
            yield chunk({"content": content})
        if kind == "done":
            yield chunk({}, finish_reason(payload))
            if include_usage:
                yield sse(chat_usage_chunk(meta, payload, n_prompt))
            yield DONE
            return


# --- /v1/completions ----------------------------------------------------------------

def text_completion(meta: dict, reply, n_prompt: int) -> dict:
    return {**meta, "object": "text_completion", "system_fingerprint": None,
            "choices": [{"index": 0, "text": reply.raw_text, "logprobs": None,
                         "finish_reason": finish_reason(reply)}],
            "usage": usage(reply, n_prompt)}


def completion_chunk(meta: dict, text: str, finish: str | None = None, *,
                     include_usage: bool = False) -> dict:
    body = {**meta, "object": "text_completion", "system_fingerprint": None,
            "choices": [{"index": 0, "text": text, "logprobs": None,
                         "finish_reason": finish}]}
    if include_usage:
        body["usage"] = None
    return body


async def completion_events(events: AsyncIterable, meta: dict, n_prompt: int, *,
                            include_usage: bool):
    async for kind, payload in events:
        if kind == "text":
            yield sse(completion_chunk(meta, payload, include_usage=include_usage))
        elif kind == "done":
            yield sse(completion_chunk(meta, "", finish_reason(payload),
                                       include_usage=include_usage))
            if include_usage:
                yield sse({**meta, "object": "text_completion", "choices": [],
                           "usage": usage(payload, n_prompt)})
            yield DONE
            return
        else:
            yield sse(error_of(payload).body())
            return


# --- /v1/responses ------------------------------------------------------------------

@dataclass
class ResponseState:
    """What a Responses answer repeats in each of its objects and events."""

    id: str                 # resp_...
    msg: str                # msg_...: the message item's id
    created: float
    model: str
    req: Any                # the ResponsesRequest
    split: bool             # the format can think
    thinking: bool          # the template opened the think block
    n_prompt: int


def response_object(state: ResponseState, reply=None) -> dict:
    """The Responses API's object: in progress (no reply yet), or finished:
    "completed", or "incomplete" when max_output_tokens (or the context) cut
    it; the think block, if any, as a reasoning item after the message."""
    req = state.req
    output, used, incomplete, status = [], None, None, "in_progress"
    if reply is not None:
        reasoning, text = split_think(reply.raw_text, state.split, state.thinking)
        status = "completed" if finish_reason(reply) == "stop" else "incomplete"
        if status == "incomplete":
            incomplete = {"reason": "max_output_tokens"}
        output.append(message_item(state, text, "completed"))
        if reasoning:
            output.append({"type": "reasoning", "id": f"rs_{state.msg[4:]}",
                           "summary": [], "content": [
                               {"type": "reasoning_text", "text": reasoning}]})
        u = usage(reply, state.n_prompt)
        used = {"input_tokens": u["prompt_tokens"],
                "input_tokens_details": {"cached_tokens": u[
                    "prompt_tokens_details"]["cached_tokens"]},
                "output_tokens": u["completion_tokens"],
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": u["total_tokens"]}
    return {"id": state.id, "object": "response", "created_at": state.created,
            "status": status, "model": state.model, "output": output,
            "error": None, "incomplete_details": incomplete,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "parallel_tool_calls": False, "tool_choice": "auto", "tools": [],
            "temperature": req.temperature, "top_p": req.top_p,
            "text": {"format": {"type": "text"}}, "usage": used,
            "metadata": {}}


def message_item(state: ResponseState, text: str, status: str) -> dict:
    content = [{"type": "output_text", "text": text, "annotations": []}] \
        if status == "completed" else []
    return {"type": "message", "id": state.msg, "status": status,
            "role": "assistant", "content": content}


async def response_events(events: AsyncIterable, state: ResponseState):
    """A job's events -> the Responses stream: named events, each numbered."""
    seq = iter(range(1 << 30))

    def event(kind, **body):
        body = {"type": kind, "sequence_number": next(seq), **body}
        return {"event": kind, "data": json.dumps(body)}

    where = dict(item_id=state.msg, output_index=0, content_index=0)
    yield event("response.created", response=response_object(state))
    yield event("response.in_progress", response=response_object(state))
    yield event("response.output_item.added", output_index=0,
                item=message_item(state, "", "in_progress"))
    yield event("response.content_part.added", **where,
                part={"type": "output_text", "text": "", "annotations": []})
    splitter = ThinkSplitter(state.thinking) if state.split else None
    async for kind, payload in events:
        if kind == "error":
            err = error_of(payload)
            yield event("error", code=err.code, message=err.message, param=err.param)
            return
        if kind == "text":
            _, content = splitter.push(payload) if splitter else ("", payload)
        else:
            _, content = splitter.finish() if splitter else ("", "")
        if content:
            yield event("response.output_text.delta", **where, delta=content,
                        logprobs=[])
        if kind == "done":
            final = response_object(state, payload)
            part = final["output"][0]["content"][0]
            yield event("response.output_text.done", **where, text=part["text"],
                        logprobs=[])
            yield event("response.content_part.done", **where, part=part)
            yield event("response.output_item.done", output_index=0,
                        item=final["output"][0])
            done = ("response.completed" if final["status"] == "completed"
                    else "response.incomplete")
            yield event(done, response=final)
            return
