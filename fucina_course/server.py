"""`fucina serve`: an OpenAI-compatible HTTP server over the engine.

Routes, shaped like OpenAI's so the official `openai` client works unmodified:

    GET  /health                 liveness and load (never needs the API key)
    GET  /v1/models[/{id}]       the one model served
    POST /v1/chat/completions    messages -> an answer (SSE stream or one object)
    POST /v1/completions         a raw prompt -> its continuation
    POST /v1/responses           the text subset of the Responses API

FastAPI + uvicorn (ASGI); every request becomes a `scheduler.Job`, decoded by the
one engine thread together with the other running jobs (scheduler.py: continuous
batching and prefix reuse).  The event loop never runs the model: it parses,
renders the chat template, encodes, and moves text from the engine to the sockets.

Errors are OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, so the
client raises its own exception classes: 400 for a malformed body, a field of the
wrong type or out of range (the OpenAI API answers 400 to those too, and the client
maps 400 to `BadRequestError`; FastAPI's usual 422 is not used), 401 for a missing
or wrong API key, 404 for an unknown model or route, 413 for a body over the limit,
429 with `Retry-After` when every slot and the queue are full, 503 while shutting
down.  A request that fails never takes the server down.

Sampling defaults are llama.cpp's server's (`SamplerConfig()`: temperature 0.8,
top-k 40, top-p 0.95, min-p 0.05), not OpenAI's temperature 1: a client that sets
nothing gets what it would get from llama-server on the same GGUF.  Qwen3 thinking:
`chat_template_kwargs.enable_thinking` (llama.cpp's convention) reaches the
template; the think block goes to `reasoning_content`, never into `content`
(`ThinkSplitter`, also while streaming).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import signal
import socket
import threading
import time
import uuid
from typing import Any, Optional, Union

from .errors import ContextFull, FucinaError
from .sampler import InvalidSamplerConfig, Sampler, SamplerConfig
from .scheduler import Busy, Job, Scheduler, ShuttingDown
from .chat import THINK_CLOSE, THINK_OPEN

log = logging.getLogger("fucina.serve")

MAX_BODY = 4 << 20     # bytes: a 4096-position context is ~16 KB of text; 4 MiB is
                       # room for long histories, not for a memory attack
RETRY_AFTER = 1        # seconds a 429 asks the client to wait (a decode step is ~0.1 s)


# --- errors -------------------------------------------------------------------------

class ApiError(Exception):
    """An error answer in OpenAI's shape."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code, self.headers = param, code, headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type,
                          "param": self.param, "code": self.code}}


def _json_response(status: int, body: dict, headers: dict | None = None):
    from starlette.responses import JSONResponse

    return JSONResponse(body, status_code=status, headers=headers)


def _error_of(exc: FucinaError) -> ApiError:
    """An engine error met while answering -> what the client is told."""
    if isinstance(exc, ShuttingDown):
        return ApiError(503, str(exc), type="server_error", code="server_shutting_down")
    if isinstance(exc, Busy):
        return ApiError(429, str(exc), type="rate_limit_error",
                        code="rate_limit_exceeded",
                        headers={"Retry-After": str(RETRY_AFTER)})
    if isinstance(exc, ContextFull):
        return ApiError(400, str(exc), code="context_length_exceeded")
    return ApiError(500, str(exc), type="server_error")


# --- request bodies -------------------------------------------------------------------

def _models():
    """The pydantic models of the request bodies, built on first use (pydantic is
    imported only by the server)."""
    from pydantic import BaseModel, ConfigDict, FiniteFloat, StrictStr

    class Body(BaseModel):
        # strict: "5" is not an integer, 1 is not a boolean (OpenAI's rules);
        # unknown fields are ignored, as OpenAI-compatible servers do (clients send
        # `user`, `store`, `metadata`, ...).
        model_config = ConfigDict(strict=True, extra="ignore")

    class TextPart(Body):
        type: StrictStr
        text: Optional[StrictStr] = None

    class Message(Body):
        role: StrictStr
        content: Union[StrictStr, list[TextPart], None] = None

    class StreamOptions(Body):
        include_usage: bool = False

    class Sampling(Body):
        model: StrictStr
        stream: bool = False
        stream_options: Optional[StreamOptions] = None
        temperature: Optional[FiniteFloat] = None
        top_p: Optional[FiniteFloat] = None
        top_k: Optional[int] = None
        min_p: Optional[FiniteFloat] = None
        repeat_penalty: Optional[FiniteFloat] = None
        repeat_last_n: Optional[int] = None
        presence_penalty: Optional[FiniteFloat] = None
        frequency_penalty: Optional[FiniteFloat] = None
        seed: Optional[int] = None
        stop: Union[StrictStr, list[StrictStr], None] = None
        n: Optional[int] = None
        response_format: Optional[dict] = None
        logprobs: Optional[Union[bool, int]] = None
        tools: Optional[list] = None

    class Chat(Sampling):
        messages: list[Message]
        max_tokens: Optional[int] = None
        max_completion_tokens: Optional[int] = None
        chat_template_kwargs: Optional[dict] = None

    class Completion(Sampling):
        prompt: Union[StrictStr, list[StrictStr], list[int]]
        max_tokens: Optional[int] = 16          # OpenAI's default for completions
        echo: Optional[bool] = None
        suffix: Optional[StrictStr] = None

    class ResponseText(Body):
        format: Optional[dict] = None

    class Responses(Sampling):
        input: Union[StrictStr, list[dict]]
        instructions: Optional[StrictStr] = None
        max_output_tokens: Optional[int] = None
        text: Optional[ResponseText] = None
        previous_response_id: Optional[StrictStr] = None

    return dict(chat=Chat, completion=Completion, responses=Responses,
                message=Message)


_MODELS: dict | None = None


def _parse(kind: str, data: Any):
    global _MODELS
    from pydantic import ValidationError

    if _MODELS is None:
        _MODELS = _models()
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        return _MODELS[kind].model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        param = _param(first.get("loc", ()))
        kind_ = first.get("type", "")
        if kind_ == "missing":
            message = f"Missing required parameter: '{param}'."
        else:
            message = f"Invalid value for '{param}': {first.get('msg')}."
        raise ApiError(400, message, param=param,
                       code="missing_required_parameter" if kind_ == "missing"
                       else "invalid_type") from None


_UNION_MEMBERS = {"str", "int", "bool", "float", "dict", "list", "none"}


def _param(loc) -> str:
    """pydantic's error location -> OpenAI's spelling: messages[0].content.  A
    union's member ("str", "list[TextPart]") appears in the location as if it were
    a field: it is left out."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part not in _UNION_MEMBERS and "[" not in str(part):
            out += ("." if out else "") + str(part)
    return out


def _sampler_config(req) -> SamplerConfig:
    changes = {name: getattr(req, name) for name in (
        "temperature", "top_p", "top_k", "min_p", "repeat_penalty", "repeat_last_n",
        "presence_penalty", "frequency_penalty", "seed") if getattr(req, name) is not None}
    try:
        return SamplerConfig(**changes)
    except InvalidSamplerConfig as e:
        raise ApiError(400, str(e), param=str(e).split()[0],
                       code="invalid_value") from None


def _stop_list(stop) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else list(stop)
    if len(stops) > 4:
        raise ApiError(400, "at most 4 stop sequences", param="stop")
    return [s for s in stops if s]


def _max_tokens(value, param: str) -> int | None:
    if value is not None and value < 1:
        raise ApiError(400, f"{param} must be at least 1, got {value}", param=param,
                       code="invalid_value")
    return value


def _text_of(content, where: str) -> str:
    """A message's content: a string, or text parts joined."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    out = []
    for i, part in enumerate(content):
        if part.type not in ("text", "input_text", "output_text") or part.text is None:
            raise ApiError(400, f"only text content is supported, got a "
                           f"{part.type!r} part", param=f"{where}.content[{i}]")
        out.append(part.text)
    return "".join(out)


ROLES = {"system": "system", "developer": "system", "user": "user",
         "assistant": "assistant"}


# --- thinking -----------------------------------------------------------------------------

class ThinkSplitter:
    """Raw answer text -> (reasoning, content), piece by piece.

    Text inside <think>...</think> is reasoning, the rest content; the tags and
    the newlines that frame the block are dropped (as `chat.without_think` drops
    them).  Text that could be the start of a tag is held back until it is known
    not to be one, so a streamed delta never shows half a tag.  `thinking=True`
    starts inside a block (a template that opens it in the prompt)."""

    def __init__(self, thinking: bool = False):
        self.thinking = thinking
        self.buf = ""
        self.lead = True              # drop newlines at the start of the next part

    def push(self, text: str, final: bool = False) -> tuple[str, str]:
        self.buf += text
        reasoning, content = [], []
        while self.buf:
            tag = THINK_CLOSE if self.thinking else THINK_OPEN
            out = reasoning if self.thinking else content
            if self.lead:
                stripped = self.buf.lstrip("\n")
                if not stripped and not final:
                    self.buf = ""
                    break
                self.buf, self.lead = stripped, False
                continue
            i = self.buf.find(tag)
            if i >= 0:
                piece = self.buf[:i]
                out.append(piece.rstrip("\n") if self.thinking else piece)
                self.buf = self.buf[i + len(tag):]
                self.thinking, self.lead = not self.thinking, True
                continue
            if final:
                out.append(self.buf)
                self.buf = ""
                break
            hold = 0                    # a tag's beginning at the end
            for n in range(min(len(tag) - 1, len(self.buf)), 0, -1):
                if self.buf.endswith(tag[:n]):
                    hold = n
                    break
            if self.thinking:            # trailing newlines may frame </think>
                body = self.buf[:len(self.buf) - hold]
                hold = len(self.buf) - len(body.rstrip("\n"))
            cut = len(self.buf) - hold
            out.append(self.buf[:cut])
            self.buf = self.buf[cut:]
            break
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        return self.push("", final=True)


# --- the application ------------------------------------------------------------------

class App:
    """The routes over one `Scheduler`.  `model_id`: the name clients pass as
    `model` (the file's name and stem are accepted too)."""

    def __init__(self, scheduler: Scheduler, model_id: str, *,
                 api_key: str | None = None, max_body: int = MAX_BODY):
        self.scheduler = scheduler
        self.model = scheduler.model
        self.tokenizer = self.model.tokenizer
        self.format = scheduler.format
        self.model_id = model_id
        path = self.model.path
        self.aliases = {model_id, path.name, path.stem}
        self.created = int(path.stat().st_mtime)
        self.api_key = api_key
        self.max_body = max_body
        self.asgi = self._build()

    # --- plumbing ----------------------------------------------------------------

    def _build(self):
        from fastapi import FastAPI
        from starlette.exceptions import HTTPException
        from starlette.responses import JSONResponse, Response

        app = FastAPI(title="fucina", docs_url=None, redoc_url=None,
                      openapi_url=None)

        @app.exception_handler(ApiError)
        async def api_error(request, exc: ApiError):
            return _json_response(exc.status, exc.body(), exc.headers)

        @app.exception_handler(HTTPException)
        async def http_error(request, exc: HTTPException):
            if exc.status_code == 404:
                message = f"Unknown request URL: {request.method} {request.url.path}"
            else:
                message = str(exc.detail)
            return _json_response(exc.status_code, ApiError(
                exc.status_code, message, code=None).body())

        @app.exception_handler(Exception)
        async def crash(request, exc: Exception):
            log.exception("request failed")
            return _json_response(500, ApiError(
                500, f"internal error: {type(exc).__name__}: {exc}",
                type="server_error").body())

        # Plain starlette endpoints (a function of the request): the bodies are
        # parsed by `_parse`, so that every mistake gets OpenAI's error shape.
        def route(path, handler, method):
            async def endpoint(request):
                result = await handler(request)
                return result if isinstance(result, Response) else JSONResponse(result)

            app.router.add_route(path, endpoint, methods=[method])

        route("/health", self.health, "GET")
        route("/v1/models", self.models, "GET")
        route("/v1/models/{name:path}", self.model_card, "GET")
        route("/v1/chat/completions", self.chat, "POST")
        route("/v1/completions", self.completions, "POST")
        route("/v1/responses", self.responses, "POST")
        return _Guard(app, self.api_key, self.max_body)

    async def health(self, request):
        """200 while the engine thread runs, 503 once it has stopped (shutting
        down, or failed: the log says why); the load either way."""
        from starlette.responses import JSONResponse

        alive = self.scheduler.alive
        return JSONResponse({"status": "ok" if alive else "unavailable",
                             **self.scheduler.snapshot()},
                            status_code=200 if alive else 503)

    async def models(self, request) -> dict:
        return {"object": "list", "data": [self._model_card()]}

    async def model_card(self, request) -> dict:
        self._check_model(request.path_params["name"])
        return self._model_card()

    def _model_card(self) -> dict:
        return {"id": self.model_id, "object": "model", "created": self.created,
                "owned_by": "fucina"}

    def _check_model(self, name: str) -> None:
        if name not in self.aliases:
            raise ApiError(404, f"The model '{name}' does not exist; this server "
                           f"serves '{self.model_id}'", param="model",
                           code="model_not_found")

    async def _body(self, request) -> Any:
        size = 0
        chunks = []
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.max_body:
                raise ApiError(413, f"the request body is over {self.max_body} bytes",
                               code="request_too_large")
            chunks.append(chunk)
        raw = b"".join(chunks)
        try:
            return json.loads(raw)
        except (ValueError, RecursionError) as e:
            raise ApiError(400, f"the request body is not valid JSON: {e}",
                           code="invalid_json") from None

    def _common(self, req) -> None:
        self._check_model(req.model)
        if req.n not in (None, 1):
            raise ApiError(400, f"n must be 1 (one answer per request), got {req.n}",
                           param="n", code="invalid_value")
        if req.logprobs:
            raise ApiError(400, "logprobs are not supported", param="logprobs")
        if req.tools:
            raise ApiError(400, "tools are not supported", param="tools")

    async def _sampler(self, req, response_format: dict | None,
                       param: str = "response_format") -> Sampler:
        config = _sampler_config(req)
        processor = None
        if response_format is not None and response_format.get("type") != "text":
            try:  # imported here: the server runs without the grammar engine
                from .grammar import GrammarError, compile_response_format
            except ImportError as e:
                raise ApiError(400, f"structured output is not available: {e}",
                               param=param) from None
            from starlette.concurrency import run_in_threadpool

            try:
                factory = await run_in_threadpool(compile_response_format,
                                                  response_format, self.tokenizer)
            except GrammarError as e:
                raise ApiError(400, str(e), param=param,
                               code="unsupported_schema") from None
            if factory is not None:
                processor = factory.processor()
        return Sampler(config, logit_processor=processor)

    def _check_length(self, ids, param: str) -> None:
        if not ids:
            raise ApiError(400, "the prompt is empty", param=param)
        room = self.scheduler.capacity
        if len(ids) + 1 > room:
            raise ApiError(400, f"the prompt has {len(ids)} tokens; the context holds "
                           f"{room} positions (at least 1 is needed to answer)",
                           param=param, code="context_length_exceeded")

    async def _render_chat(self, messages: list[dict], thinking: bool):
        from starlette.concurrency import run_in_threadpool

        def render():
            text = self.format.render(messages, no_think=not thinking)
            return text, self.tokenizer.encode_raw(text)

        try:
            return await run_in_threadpool(render)
        except FucinaError as e:
            raise ApiError(400, f"the messages cannot be rendered: {e}",
                           param="messages") from None

    def _submit(self, ids, text, sampler, max_tokens, stop) -> "_Pending":
        pending = _Pending(asyncio.get_running_loop())
        job = Job(ids=ids, text=text, sampler=sampler, sink=pending.sink,
                  max_tokens=max_tokens, stop=stop)
        try:
            self.scheduler.submit(job)
        except FucinaError as e:
            raise _error_of(e) from None
        pending.job = job
        pending.cancel = lambda: self.scheduler.cancel(job)
        return pending

    def _starts_thinking(self, text: str) -> bool:
        """Did the template open a think block the model is to continue?"""
        tail = text.rstrip("\n")
        return self.format.can_think and tail.endswith(THINK_OPEN)

    # --- /v1/chat/completions -------------------------------------------------------

    async def chat(self, request):
        req = _parse("chat", await self._body(request))
        self._common(req)
        if not req.messages:
            raise ApiError(400, "messages must not be empty", param="messages")
        messages = []
        for i, m in enumerate(req.messages):
            role = ROLES.get(m.role)
            if role is None:
                raise ApiError(400, f"unsupported role {m.role!r} (use system, user or "
                               f"assistant)", param=f"messages[{i}].role")
            messages.append({"role": role,
                             "content": _text_of(m.content, f"messages[{i}]")})
        kwargs = req.chat_template_kwargs or {}
        thinking = kwargs.get("enable_thinking", True)
        if not isinstance(thinking, bool):
            raise ApiError(400, "enable_thinking must be a boolean",
                           param="chat_template_kwargs.enable_thinking")
        max_tokens = _max_tokens(req.max_completion_tokens, "max_completion_tokens") \
            if req.max_completion_tokens is not None \
            else _max_tokens(req.max_tokens, "max_tokens")
        stop = _stop_list(req.stop)
        text, ids = await self._render_chat(messages, thinking)
        self._check_length(ids, "messages")
        sampler = await self._sampler(req, req.response_format)
        pending = self._submit(ids, text, sampler, max_tokens, stop)
        split = self.format.can_think
        meta = dict(id=f"chatcmpl-{uuid.uuid4().hex[:24]}", created=int(time.time()),
                    model=self.model_id)
        if req.stream:
            usage = bool(req.stream_options and req.stream_options.include_usage)
            return _EventStream(self._chat_events(pending, meta, split,
                                                  self._starts_thinking(text), usage),
                                pending.cancel)
        reply = await pending.result(request)
        reasoning, content = self._split(reply.raw_text, split,
                                         self._starts_thinking(text))
        message = {"role": "assistant", "content": content}
        if reasoning:
            message["reasoning_content"] = reasoning
        return {**meta, "object": "chat.completion", "system_fingerprint": None,
                "choices": [{"index": 0, "message": message, "logprobs": None,
                             "finish_reason": _finish_reason(reply)}],
                "usage": _usage(reply, len(ids))}

    def _split(self, raw: str, split: bool, thinking: bool) -> tuple[str, str]:
        if not split:
            return "", raw
        splitter = ThinkSplitter(thinking)
        r1, c1 = splitter.push(raw)
        r2, c2 = splitter.finish()
        return r1 + r2, c1 + c2

    async def _chat_events(self, pending, meta, split, thinking, include_usage):
        def chunk(delta, finish=None, **extra):
            body = {**meta, "object": "chat.completion.chunk", "system_fingerprint": None,
                    "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                 "finish_reason": finish}]}
            if include_usage:
                body["usage"] = None
            body.update(extra)
            return _sse(body)

        splitter = ThinkSplitter(thinking) if split else None
        yield chunk({"role": "assistant", "content": ""})
        async for kind, payload in pending.events():
            if kind == "text":
                reasoning, content = splitter.push(payload) if splitter else ("", payload)
            elif kind == "done":
                reasoning, content = splitter.finish() if splitter else ("", "")
            else:
                yield _sse(_error_of(payload).body())
                return
            if reasoning:
                yield chunk({"reasoning_content": reasoning})
            if content:
                yield chunk({"content": content})
            if kind == "done":
                yield chunk({}, _finish_reason(payload))
                if include_usage:
                    body = {**meta, "object": "chat.completion.chunk",
                            "system_fingerprint": None, "choices": [],
                            "usage": _usage(payload, len(pending.job.ids))}
                    yield _sse(body)
                yield "data: [DONE]\n\n"
                return

    # --- /v1/completions -------------------------------------------------------------

    async def completions(self, request):
        req = _parse("completion", await self._body(request))
        self._common(req)
        if req.echo or req.suffix:
            raise ApiError(400, "echo and suffix are not supported",
                           param="echo" if req.echo else "suffix")
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            if len(prompt) != 1:
                raise ApiError(400, "one prompt per request", param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            text = prompt
            ids = self.tokenizer.encode(prompt)
        else:
            ids = list(prompt)
            bad = [i for i in ids if not 0 <= i < self.model.config.vocab_size]
            if bad:
                raise ApiError(400, f"token id {bad[0]} is outside the vocabulary",
                               param="prompt")
            text = self.tokenizer.decode(ids)
        self._check_length(ids, "prompt")
        max_tokens = _max_tokens(req.max_tokens, "max_tokens")
        sampler = await self._sampler(req, req.response_format)
        pending = self._submit(ids, text, sampler, max_tokens, _stop_list(req.stop))
        meta = dict(id=f"cmpl-{uuid.uuid4().hex[:24]}", created=int(time.time()),
                    model=self.model_id)
        if req.stream:
            usage = bool(req.stream_options and req.stream_options.include_usage)
            return _EventStream(self._completion_events(pending, meta, usage),
                                pending.cancel)
        reply = await pending.result(request)
        return {**meta, "object": "text_completion", "system_fingerprint": None,
                "choices": [{"index": 0, "text": reply.raw_text, "logprobs": None,
                             "finish_reason": _finish_reason(reply)}],
                "usage": _usage(reply, len(ids))}

    async def _completion_events(self, pending, meta, include_usage):
        def chunk(text, finish=None):
            body = {**meta, "object": "text_completion", "system_fingerprint": None,
                    "choices": [{"index": 0, "text": text, "logprobs": None,
                                 "finish_reason": finish}]}
            if include_usage:
                body["usage"] = None
            return _sse(body)

        async for kind, payload in pending.events():
            if kind == "text":
                yield chunk(payload)
            elif kind == "done":
                yield chunk("", _finish_reason(payload))
                if include_usage:
                    yield _sse({**meta, "object": "text_completion", "choices": [],
                                "usage": _usage(payload, len(pending.job.ids))})
                yield "data: [DONE]\n\n"
                return
            else:
                yield _sse(_error_of(payload).body())
                return

    # --- /v1/responses -----------------------------------------------------------------

    async def responses(self, request):
        req = _parse("responses", await self._body(request))
        self._common(req)
        if req.previous_response_id:
            raise ApiError(400, "previous_response_id is not supported: this server "
                           "stores no responses; send the history in `input`",
                           param="previous_response_id")
        messages = [{"role": "system", "content": req.instructions}] \
            if req.instructions else []
        if isinstance(req.input, str):
            messages.append({"role": "user", "content": req.input})
        else:
            for i, item in enumerate(req.input):
                messages.append(self._response_item(item, f"input[{i}]"))
        if not any(m["role"] != "system" for m in messages):
            raise ApiError(400, "input must hold at least one message", param="input")
        max_tokens = _max_tokens(req.max_output_tokens, "max_output_tokens")
        response_format = None
        if req.text is not None and req.text.format is not None:
            fmt = dict(req.text.format)     # the Responses API's spelling
            if fmt.get("type") == "json_schema":
                response_format = {"type": "json_schema", "json_schema": {
                    k: v for k, v in fmt.items() if k in ("name", "schema", "strict")}}
            else:
                response_format = fmt
        text, ids = await self._render_chat(messages, thinking=True)
        self._check_length(ids, "input")
        sampler = await self._sampler(req, response_format, "text.format")
        pending = self._submit(ids, text, sampler, max_tokens, _stop_list(req.stop))
        state = dict(id=f"resp_{uuid.uuid4().hex[:24]}", msg=f"msg_{uuid.uuid4().hex[:24]}",
                     created=time.time(), req=req, split=self.format.can_think,
                     thinking=self._starts_thinking(text), n_prompt=len(ids))
        if req.stream:
            return _EventStream(self._response_events(pending, state), pending.cancel)
        reply = await pending.result(request)
        return self._response_object(state, reply)

    @staticmethod
    def _response_item(item: dict, where: str) -> dict:
        if item.get("type", "message") != "message":
            raise ApiError(400, f"only message items are supported, got "
                           f"{item.get('type')!r}", param=f"{where}.type")
        role = ROLES.get(item.get("role"))
        if role is None:
            raise ApiError(400, f"unsupported role {item.get('role')!r}",
                           param=f"{where}.role")
        content = item.get("content")
        if isinstance(content, str):
            return {"role": role, "content": content}
        if not isinstance(content, list):
            raise ApiError(400, "content must be a string or a list of text parts",
                           param=f"{where}.content")
        parts = []
        for j, part in enumerate(content):
            if (not isinstance(part, dict) or part.get("type") not in
                    ("input_text", "output_text", "text")
                    or not isinstance(part.get("text"), str)):
                raise ApiError(400, "only text parts are supported",
                               param=f"{where}.content[{j}]")
            parts.append(part["text"])
        return {"role": role, "content": "".join(parts)}

    def _response_object(self, state, reply=None) -> dict:
        """The Responses API's object: in progress (no reply yet), or finished:
        "completed", or "incomplete" when max_output_tokens (or the context) cut
        it; the think block, if any, as a reasoning item after the message."""
        req = state["req"]
        output, usage, incomplete, status = [], None, None, "in_progress"
        if reply is not None:
            reasoning, text = self._split(reply.raw_text, state["split"],
                                          state["thinking"])
            status = "completed" if _finish_reason(reply) == "stop" else "incomplete"
            if status == "incomplete":
                incomplete = {"reason": "max_output_tokens"}
            output.append(self._message_item(state, text, "completed"))
            if reasoning:
                output.append({"type": "reasoning", "id": f"rs_{state['msg'][4:]}",
                               "summary": [], "content": [
                                   {"type": "reasoning_text", "text": reasoning}]})
            u = _usage(reply, state["n_prompt"])
            usage = {"input_tokens": u["prompt_tokens"],
                     "input_tokens_details": {"cached_tokens": u[
                         "prompt_tokens_details"]["cached_tokens"]},
                     "output_tokens": u["completion_tokens"],
                     "output_tokens_details": {"reasoning_tokens": 0},
                     "total_tokens": u["total_tokens"]}
        return {"id": state["id"], "object": "response", "created_at": state["created"],
                "status": status, "model": self.model_id, "output": output,
                "error": None, "incomplete_details": incomplete,
                "instructions": req.instructions,
                "max_output_tokens": req.max_output_tokens,
                "parallel_tool_calls": False, "tool_choice": "auto", "tools": [],
                "temperature": req.temperature, "top_p": req.top_p,
                "text": {"format": {"type": "text"}}, "usage": usage,
                "metadata": {}}

    @staticmethod
    def _message_item(state, text: str, status: str) -> dict:
        content = [{"type": "output_text", "text": text, "annotations": []}] \
            if status == "completed" else []
        return {"type": "message", "id": state["msg"], "status": status,
                "role": "assistant", "content": content}

    async def _response_events(self, pending, state):
        seq = iter(range(1 << 30))

        def event(kind, **body):
            body = {"type": kind, "sequence_number": next(seq), **body}
            return f"event: {kind}\ndata: {json.dumps(body)}\n\n"

        where = dict(item_id=state["msg"], output_index=0, content_index=0)
        yield event("response.created", response=self._response_object(state))
        yield event("response.in_progress", response=self._response_object(state))
        yield event("response.output_item.added", output_index=0,
                    item=self._message_item(state, "", "in_progress"))
        yield event("response.content_part.added", **where,
                    part={"type": "output_text", "text": "", "annotations": []})
        splitter = ThinkSplitter(state["thinking"]) if state["split"] else None
        async for kind, payload in pending.events():
            if kind == "error":
                err = _error_of(payload)
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
                final = self._response_object(state, payload)
                text = final["output"][0]["content"][0]["text"]
                yield event("response.output_text.done", **where, text=text,
                            logprobs=[])
                yield event("response.content_part.done", **where,
                            part=final["output"][0]["content"][0])
                yield event("response.output_item.done", output_index=0,
                            item=final["output"][0])
                done = ("response.completed" if final["status"] == "completed"
                        else "response.incomplete")
                yield event(done, response=final)
                return


# --- answers -----------------------------------------------------------------------------

def _finish_reason(reply) -> str:
    """The engine's stop reason -> OpenAI's: the end marker or a stop string is
    "stop"; max_tokens or a full context is "length"."""
    return "stop" if reply.stop_reason in ("end", "stop_string") else "length"


def _usage(reply, n_prompt: int) -> dict:
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


def _sse(body: dict) -> str:
    return f"data: {json.dumps(body)}\n\n"


class _Pending:
    """A submitted job as the event loop sees it: the engine thread's events,
    moved into an asyncio queue (`sink` is thread-safe)."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.job: Job | None = None
        self.cancel = lambda: None

    def sink(self, kind: str, payload) -> None:      # engine thread
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (kind, payload))
        except RuntimeError:     # the loop is closed: nobody is listening
            pass

    async def events(self):
        while True:
            kind, payload = await self.queue.get()
            yield kind, payload
            if kind != "text":
                return

    async def result(self, request):
        """The reply, once the job is done; the job is cancelled if the client goes
        away first (its slot is free at the next step)."""
        try:
            while True:
                try:
                    kind, payload = await asyncio.wait_for(self.queue.get(), 0.25)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        self.cancel()
                        raise ApiError(499, "client closed the request") from None
                    continue
                if kind == "done":
                    return payload
                if kind == "error":
                    raise _error_of(payload)
        finally:
            if self.job is not None and not self.job.over:
                self.cancel()


def _event_stream_class():
    from starlette.responses import StreamingResponse
    import anyio

    class EventStream(StreamingResponse):
        """Server-sent events that notice a client going away at once.

        The stream is raced against the connection's `http.disconnect` in a task
        group, whatever ASGI version the server speaks (starlette's own response
        only notices a disconnect at its next write on ASGI 2.4, i.e. at the next
        token: the job would run on, holding a slot).  Whenever the response ends,
        `on_close` cancels the job (a no-op if it is over)."""

        def __init__(self, content, on_close):
            super().__init__(content, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache",
                                      "X-Accel-Buffering": "no"})
            self.on_close = on_close

        async def __call__(self, scope, receive, send):
            try:
                async with anyio.create_task_group() as group:
                    async def stream():
                        try:
                            await self.stream_response(send)
                        except OSError:
                            pass
                        group.cancel_scope.cancel()

                    group.start_soon(stream)
                    await self.listen_for_disconnect(receive)
                    group.cancel_scope.cancel()
            finally:
                self.on_close()

    return EventStream


def _EventStream(content, on_close):
    global _EVENT_STREAM
    if _EVENT_STREAM is None:
        _EVENT_STREAM = _event_stream_class()
    return _EVENT_STREAM(content, on_close)


_EVENT_STREAM = None


class _Guard:
    """Pure ASGI middleware: the API key (every route but /health) and the body
    size limit by Content-Length, before any route runs (a chunked body is also
    counted as it is read: `App._body`).  Pure ASGI rather than starlette's
    BaseHTTPMiddleware, which wraps streaming responses and gets in the way of
    noticing a disconnect."""

    def __init__(self, app, api_key: str | None, max_body: int):
        self.app, self.max_body = app, max_body
        self.key = f"Bearer {api_key}".encode() if api_key else None

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            headers = dict(scope.get("headers") or [])
            if self.key is not None and scope.get("path") != "/health":
                given = headers.get(b"authorization", b"")
                if not hmac.compare_digest(given, self.key):
                    return await _send(send, ApiError(
                        401, "Incorrect or missing API key: send 'Authorization: "
                        "Bearer <key>'", code="invalid_api_key"))
            length = headers.get(b"content-length")
            if length is not None:
                try:
                    too_big = int(length) > self.max_body
                except ValueError:
                    too_big = False
                if too_big:
                    return await _send(send, ApiError(
                        413, f"the request body is over {self.max_body} bytes",
                        code="request_too_large"))
        await self.app(scope, receive, send)


async def _send(send, error: ApiError) -> None:
    body = json.dumps(error.body()).encode()
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), str(v).encode()) for k, v in error.headers.items()]
    await send({"type": "http.response.start", "status": error.status,
                "headers": headers})
    await send({"type": "http.response.body", "body": body})


# --- running it -----------------------------------------------------------------------

class Server:
    """A scheduler, the app, and uvicorn on a socket bound at construction (so a
    busy port is a `FucinaError` before anything starts, and port 0 picks a free
    one: `url` says which).  `run()` serves in this thread until SIGINT/SIGTERM;
    `start()` serves in a background thread (tests, notebooks) until `stop()`."""

    def __init__(self, model, *, model_id: str | None = None, host: str = "127.0.0.1",
                 port: int = 8080, parallel: int = 4, ctx: int | None = None,
                 cache_type: str = "f16", queue_size: int | None = None,
                 api_key: str | None = None, max_body: int = MAX_BODY,
                 prefill_chunk: int = 64, log_level: str = "warning",
                 speculator=None):
        import importlib.util

        missing = [m for m in ("fastapi", "uvicorn") if not importlib.util.find_spec(m)]
        if missing:
            raise FucinaError(f"fucina serve needs {' and '.join(missing)}: "
                              "pip install -r requirements.txt")
        self.scheduler = Scheduler(model, parallel=parallel, capacity=ctx,
                                   cache_type=cache_type, queue_size=queue_size,
                                   prefill_chunk=prefill_chunk,
                                   speculator=speculator)
        self.app = App(self.scheduler, model_id or model.path.stem, api_key=api_key,
                       max_body=max_body)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.socket = socket.socket(family, socket.SOCK_STREAM)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.socket.bind((host, port))
            self.socket.listen(128)
        except OSError as e:
            self.socket.close()
            raise FucinaError(f"cannot listen on {host}:{port}: {e.strerror or e}") \
                from None
        self.host, self.port = host, self.socket.getsockname()[1]
        self.log_level = log_level
        self._uvicorn = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def _make_uvicorn(self):
        import uvicorn

        scheduler = self.scheduler

        class Uvicorn(uvicorn.Server):
            def handle_exit(self, sig, frame):
                # Cancel the running requests first, so their streams end now and
                # the graceful shutdown does not wait for whole answers; and do not
                # record the signal (uvicorn re-raises recorded signals after
                # shutting down, which would turn a clean exit into death by
                # SIGTERM, or a KeyboardInterrupt traceback).
                scheduler.shutdown()
                if self.should_exit and sig == signal.SIGINT:
                    self.force_exit = True
                else:
                    self.should_exit = True

        config = uvicorn.Config(self.app.asgi, log_level=self.log_level,
                                timeout_graceful_shutdown=5, lifespan="off",
                                access_log=False)
        self._uvicorn = Uvicorn(config)
        return self._uvicorn

    def run(self) -> None:
        """Serve until SIGINT or SIGTERM; then cancel what runs and return."""
        server = self._make_uvicorn()
        self.scheduler.start()
        try:
            server.run(sockets=[self.socket])
        finally:
            self.scheduler.shutdown()
            self.scheduler.join(10)
            self.socket.close()

    def start(self) -> "Server":
        """Serve in a background thread; returns once the server accepts requests."""
        server = self._make_uvicorn()
        self.scheduler.start()
        self._thread = threading.Thread(target=server.run,
                                        kwargs=dict(sockets=[self.socket]),
                                        name="fucina-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise FucinaError("the server did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.scheduler.shutdown()
        if self._uvicorn is not None:
            self._uvicorn.should_exit = True
        if self._thread is not None:
            self._thread.join(15)
        self.scheduler.join(10)
        self.socket.close()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


def is_loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


