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
half a tag is never shown).  Token counts are real: `usage` (the think block's
ids are its `reasoning_tokens`).
"""

from __future__ import annotations

import asyncio
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


def sampled(reply) -> int:
    """Every token the sampler chose: the answer's ids, and the end marker or the
    token that completed a stop string (generated, though not kept or shown)."""
    return len(reply.ids) + (reply.stop_reason in ("end", "stop_string"))


def usage(reply, n_prompt: int, reasoning: int = 0) -> dict:
    """Real token counts.  completion_tokens: `sampled(reply)`; prompt_tokens: the
    whole prompt, of which `cached_tokens` were found in the slot's cache (prefix
    reuse) and not prefilled again; `reasoning`: `reasoning_tokens`."""
    n = sampled(reply)
    return {"prompt_tokens": n_prompt, "completion_tokens": n,
            "total_tokens": n_prompt + n,
            "prompt_tokens_details": {"cached_tokens": reply.reused},
            "completion_tokens_details": {"reasoning_tokens": reasoning}}


def reasoning_tokens(ids, thinking: bool, think_ids: tuple[int, int] | None) -> int:
    """How many of the answer's `ids` are its think block: every id inside a
    block, its `<think>` and `</think>` ids included.  A block starts at the
    start when the template opened it (`thinking`) or at a `<think>` id, and ends
    at the next `</think>` id (or with the answer, when it is cut before that).
    So Qwen3's "<think>...</think>\\n\\nParis." counts the ids up to and
    including `</think>`, and the newlines after it are content (as
    `ThinkSplitter` sees them).  Not counted: the end marker (it ends the
    answer, it is not in `ids`), and tags the model spelled with ordinary
    tokens.  `think_ids`: (`<think>`, `</think>`) of a format that can think
    (`ChatFormat.think_ids`); None: 0."""
    if think_ids is None:
        return 0
    open_id, close_id = think_ids
    inside, n = thinking, 0
    for i in ids:
        if inside or i == open_id:
            n += 1
            inside = i != close_id
    return n


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
                    thinking: bool, think_ids: tuple[int, int] | None = None) -> dict:
    """The `chat.completion` object.  `meta`: id, created, model; `think_ids`:
    the format's, for `reasoning_tokens`."""
    reasoning, content = split_think(reply.raw_text, split, thinking)
    message = {"role": "assistant", "content": content}
    if reasoning:
        message["reasoning_content"] = reasoning
    counted = reasoning_tokens(reply.ids, thinking, think_ids if split else None)
    return {**meta, "object": "chat.completion", "system_fingerprint": None,
            "choices": [{"index": 0, "message": message, "logprobs": None,
                         "finish_reason": finish_reason(reply)}],
            "usage": usage(reply, n_prompt, counted)}


def chat_chunk(meta: dict, delta: dict, finish: str | None = None, *,
               include_usage: bool = False, index: int = 0,
               logprobs: dict | None = None) -> dict:
    body = {**meta, "object": "chat.completion.chunk", "system_fingerprint": None,
            "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                         "finish_reason": finish}]}
    if include_usage:
        body["usage"] = None
    return body


def chat_usage_chunk(meta: dict, reply, n_prompt: int, reasoning: int = 0) -> dict:
    """The last chunk when `stream_options.include_usage`: no choices, the usage."""
    return {**meta, "object": "chat.completion.chunk", "system_fingerprint": None,
            "choices": [], "usage": usage(reply, n_prompt, reasoning)}


async def chat_events(events: AsyncIterable, meta: dict, n_prompt: int, *,
                      split: bool, thinking: bool, include_usage: bool,
                      think_ids: tuple[int, int] | None = None, index: int = 0,
                      spell=None):
    """A job's events -> the chat stream: the role, the deltas (reasoning and
    content apart), the finish reason, the usage if asked, [DONE]; or an error
    body, after which the stream ends.  `index`: the choice's (n > 1: `merged`).
    `spell` (a token id -> its bytes): log-probabilities were asked; each delta
    carries the entries of the tokens that arrived since the previous one (a
    text piece's, `generation.Piece`), the finish chunk those left."""
    def chunk(delta, finish=None, entries=None):
        return sse(chat_chunk(meta, delta, finish, include_usage=include_usage,
                              index=index, logprobs=chat_logprobs(entries, spell)))

    splitter = ThinkSplitter(thinking) if split else None
    held, seen = ([], 0) if spell else (None, 0)    # entries not yet sent; received
    yield chunk({"role": "assistant", "content": ""})
    async for kind, payload in events:
        if kind == "text":
            reasoning, content = splitter.push(payload) if splitter else ("", payload)
            new = getattr(payload, "logprobs", None) or []
        elif kind == "done":
            reasoning, content = splitter.finish() if splitter else ("", "")
            new = (getattr(payload, "logprobs", None) or [])[seen:]
        else:
            yield sse(error_of(payload).body())
            return
        if held is not None:
            held, seen = held + new, seen + len(new)
        if reasoning:
            yield chunk({"reasoning_content": reasoning}, entries=held)
            held = None if held is None else []
        if content:
            yield chunk({"content": content}, entries=held)
            held = None if held is None else []
        if kind == "done":
            yield chunk({}, finish_reason(payload), held)
            if include_usage:
                yield sse(chat_usage_chunk(meta, payload, n_prompt, reasoning_tokens(
                    payload.ids, thinking, think_ids if split else None)))
            yield DONE
            return


# --- /v1/completions ----------------------------------------------------------------

def text_completion(meta: dict, reply, n_prompt: int) -> dict:
    return {**meta, "object": "text_completion", "system_fingerprint": None,
            "choices": [{"index": 0, "text": reply.raw_text, "logprobs": None,
                         "finish_reason": finish_reason(reply)}],
            "usage": usage(reply, n_prompt)}


def completion_chunk(meta: dict, text: str, finish: str | None = None, *,
                     include_usage: bool = False, index: int = 0,
                     logprobs: dict | None = None) -> dict:
    body = {**meta, "object": "text_completion", "system_fingerprint": None,
            "choices": [{"index": index, "text": text, "logprobs": logprobs,
                         "finish_reason": finish}]}
    if include_usage:
        body["usage"] = None
    return body


async def completion_events(events: AsyncIterable, meta: dict, n_prompt: int, *,
                            include_usage: bool, index: int = 0, spell=None,
                            offset: int = 0):
    """A job's events -> the completion stream.  `index`: the choice's; `spell`:
    log-probabilities were asked (`completion_logprobs`; `offset`: the prompt's
    length), each chunk with its tokens', the last chunk with those left."""
    seen = 0

    def chunk(text, finish=None, entries=()):
        nonlocal offset, seen
        lp = completion_logprobs(entries, spell, offset) if spell else None
        if lp is not None:
            offset += sum(map(len, lp["tokens"]))
        seen += len(entries)
        return sse(completion_chunk(meta, text, finish, include_usage=include_usage,
                                    index=index, logprobs=lp))

    async for kind, payload in events:
        if kind == "text":
            yield chunk(payload, None, getattr(payload, "logprobs", None) or [])
        elif kind == "done":
            yield chunk("", finish_reason(payload),
                        (getattr(payload, "logprobs", None) or [])[seen:])
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
    think_ids: tuple[int, int] | None = None    # the format's: reasoning_tokens


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
        u = usage(reply, state.n_prompt, reasoning_tokens(
            reply.ids, state.thinking, state.think_ids if state.split else None))
        used = {"input_tokens": u["prompt_tokens"],
                "input_tokens_details": {"cached_tokens": u[
                    "prompt_tokens_details"]["cached_tokens"]},
                "output_tokens": u["completion_tokens"],
                "output_tokens_details": {"reasoning_tokens": u[
                    "completion_tokens_details"]["reasoning_tokens"]},
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


# --- log-probabilities, and n choices ----------------------------------------------

def _spelled(spell, tid: int) -> dict:
    """A token as OpenAI lists it: its bytes as UTF-8 text (a piece of a character
    as U+FFFD), and the exact bytes."""
    raw = spell(tid)
    return {"token": raw.decode("utf-8", "replace"), "bytes": list(raw)}


def chat_logprobs(entries, spell) -> dict | None:
    """Chat's `logprobs` of the answer's tokens (`generation.TokenLogprob`s; None:
    not asked): {"content": [{token, logprob, bytes, top_logprobs: [{token,
    logprob, bytes}, ...]}, ...], "refusal": None}.  `spell(id)`: a token's bytes."""
    if entries is None:
        return None

    def one(tid: int, logprob: float) -> dict:
        out = _spelled(spell, tid)
        return {"token": out["token"], "logprob": logprob, "bytes": out["bytes"]}

    return {"content": [{**one(e.id, e.logprob),
                         "top_logprobs": [one(i, lp) for i, lp in e.top]}
                        for e in entries], "refusal": None}


def completion_logprobs(entries, spell, offset: int) -> dict | None:
    """The legacy completions' `logprobs`: `tokens`, `token_logprobs`,
    `top_logprobs` (per token {text: logprob} of the k best and the chosen one, so
    up to k + 1 as OpenAI documents; of two ids with one text the better is kept)
    and `text_offset` (each token's character offset in the prompt and
    completion, the first at `offset`, the prompt's length, as OpenAI counts)."""
    if entries is None:
        return None
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for e in entries:
        text = _spelled(spell, e.id)["token"]
        top: dict[str, float] = {}
        for tid, logprob in [*e.top, (e.id, e.logprob)]:
            top.setdefault(_spelled(spell, tid)["token"], logprob)
        out["tokens"].append(text)
        out["token_logprobs"].append(e.logprob)
        out["top_logprobs"].append(top)
        out["text_offset"].append(offset)
        offset += len(text)
    return out


def merged_usage(usages: list[dict]) -> dict:
    """The usage of n choices of one prompt: the prompt once, the completion and
    reasoning tokens summed, `cached_tokens` the fewest any choice found (the
    choice that prefilled the prompt: the others copy it, scheduler.py)."""
    n_prompt = usages[0]["prompt_tokens"]
    done = sum(u["completion_tokens"] for u in usages)
    return {"prompt_tokens": n_prompt, "completion_tokens": done,
            "total_tokens": n_prompt + done,
            "prompt_tokens_details": {"cached_tokens": min(
                u["prompt_tokens_details"]["cached_tokens"] for u in usages)},
            "completion_tokens_details": {"reasoning_tokens": sum(
                u["completion_tokens_details"]["reasoning_tokens"] for u in usages)}}


def several(bodies: list[dict]) -> dict:
    """The objects of the n choices of one request, each built alone -> one:
    choice i at index i, the usage `merged_usage` (one choice: its object)."""
    if len(bodies) == 1:
        return bodies[0]
    body = dict(bodies[0])
    body["choices"] = [{**b["choices"][0], "index": i} for i, b in enumerate(bodies)]
    body["usage"] = merged_usage([b["usage"] for b in bodies])
    return body


async def merged(streams: list):
    """The streams of n choices (each built alone, with its `index`) as one, each
    event as it comes, a choice's in their order.  Each stream's ending is held
    back, its usage chunk (`"choices": []`) and [DONE]: once every choice is done
    one usage chunk (`merged_usage`) if asked, then [DONE].  An error event of any
    choice ends the stream (the response's close cancels every choice's job)."""
    nexts: dict = {}
    usages: list[dict] = []

    def ask(stream) -> None:
        nexts[asyncio.ensure_future(anext(stream))] = stream

    for stream in streams:
        ask(aiter(stream))
    try:
        while nexts:
            done, _ = await asyncio.wait(nexts, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                stream = nexts.pop(task)
                try:
                    event = task.result()
                except StopAsyncIteration:
                    continue
                ask(stream)
                data = event.get("data") or ""
                if data == "[DONE]":
                    continue
                if data.startswith("{") and '"choices": []' in data:
                    usages.append(json.loads(data))
                    continue
                yield event
                if data.startswith('{"error"'):
                    return
        if usages:
            total = merged_usage([u["usage"] for u in usages])
            yield sse({**usages[0], "usage": total})
        yield DONE
    finally:
        for task in nexts:
            task.cancel()
