"""The application: FastAPI routes over one `Scheduler`, every request a
`scheduler.Job` decoded by the one engine thread together with the other running
jobs (scheduler.py: continuous batching and prefix reuse).

The event loop only reads bodies and moves text from the engine to the sockets: it
answers /health at once whatever the requests hold.  Everything whose cost grows
with a body (JSON parsing, validation, rendering the chat template, encoding,
decoding a list of ids, compiling a grammar) runs in a worker thread
(`App._prepare`).  Before that, the request takes its place in the scheduler's
load (`Scheduler.reserve`: 429 when parallel + queue_size requests are already
being prepared or run, so hostile requests cannot all tokenize at once); and
before anything is encoded, a prompt of B bytes is refused if even
ceil(B / the longest token's bytes) tokens would not fit the context
(`App._check_bound`: no token spells more bytes than that).  Measured before: one
200,000-character prompt, tokenized on the event loop by a quadratic BPE, held
every client (and /health) for six minutes before its 400.

A request that fails never takes the server down: its error is an OpenAI-shaped
answer (schema.py), a bug in a route a 500 with the log's traceback.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass

from fastapi import FastAPI
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse, Response

from ..errors import FucinaError
from ..kv_cache import prompt_fits
from ..sampler import Sampler, SamplerConfig
from ..scheduler import Job, Scheduler
from ..text_stream import THINK_OPEN
from . import answers
from .guard import Access, Guard
from .schema import (ApiError, SamplingRequest, chat_messages, error_of, max_tokens,
                     parse, response_format_of, response_messages, sampler_config,
                     stop_list)
from .stream import EventStream, Pending

log = logging.getLogger("fucina.serve")

MAX_BODY = 4 << 20     # bytes: a 4096-position context is ~16 KB of text; 4 MiB is
                       # room for long histories, not for a memory attack


@dataclass
class Prepared:
    """A request made ready in the worker thread: what its job runs, and its body
    (the answer's shape depends on it)."""

    req: SamplingRequest
    text: str
    ids: list[int]
    sampler: Sampler
    max_tokens: int | None
    stop: list[str]


def _json_response(status: int, body: dict, headers: dict | None = None):
    return JSONResponse(body, status_code=status, headers=headers)


def _meta(prefix: str, model_id: str) -> dict:
    """The id, time and model every chat or completion object (and chunk) repeats."""
    return dict(id=f"{prefix}-{uuid.uuid4().hex[:24]}", created=int(time.time()),
                model=model_id)


class App:
    """The routes over one `Scheduler`.  `model_id`: the name clients pass as
    `model` (the file's name and stem are accepted too).  `access`: who may call
    from a browser, and under which Host names (`Access`; default: loopback only,
    no other origin).  `asgi`: the application, behind its `Guard`."""

    def __init__(self, scheduler: Scheduler, model_id: str, *,
                 api_key: str | None = None, max_body: int = MAX_BODY,
                 access: Access | None = None):
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
        self.access = access if access is not None else Access("127.0.0.1", 0)
        # no token spells more bytes than this: a prompt of B bytes has at least
        # ceil(B / longest_token) tokens (`_check_bound`)
        self.longest_token = max(1, max(map(len, self.tokenizer.token_bytes)))
        self.asgi = Guard(self._build(), self.api_key, self.max_body, self.access)

    # --- plumbing ----------------------------------------------------------------

    def _build(self) -> FastAPI:
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
        # parsed by `schema.parse`, so that every mistake gets OpenAI's error shape.
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
        return app

    async def health(self, request):
        """200 while the engine thread runs, 503 once it has stopped (shutting
        down, or failed: the log says why); the load either way."""
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

    async def _body(self, request) -> bytes:
        """The raw body, at most `max_body` bytes (a chunked body is counted as it
        arrives); parsing it is `_prepare`'s work, off the event loop."""
        size = 0
        chunks = []
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > self.max_body:
                    raise ApiError(413, f"the request body is over {self.max_body} "
                                   "bytes", code="request_too_large")
                chunks.append(chunk)
        except ClientDisconnect:         # gone mid-body: nobody to answer, no alarm
            raise ApiError(499, "client closed the request") from None
        return b"".join(chunks)

    # --- a request, from its body to a submitted job -----------------------------

    async def _serve(self, kind: str, request, respond):
        """Read the body, reserve a place in the load, prepare and submit the job
        in a worker thread, then `respond(request, prepared, pending)`.

        Worker thread: starlette's `run_in_threadpool` (anyio's pool, 40 threads).
        The reservation already bounds how many requests are being prepared at
        once (parallel + queue_size), so the pool needs no bound of its own.
        Rejected alternative: a small dedicated executor, which would queue a
        two-word chat behind a 4 MiB prompt's encoding (head-of-line blocking).
        The thread is not abandoned if this task is cancelled (anyio waits for
        it), so a place is never freed while its work still runs.

        A thread shares the GIL with the engine: measured (2 cores), a 200 KB
        one-word prompt encoded by the old quadratic BPE slowed a concurrent
        two-word chat from 0.6 s to 52 s (each of its list operations over 200,000
        parts held the GIL for tens of ms), though /health stayed at 0.1 s; with
        the O(n log n) BPE and its chunk cap the same prompt costs ~0.5 s, and
        five of them at once delay that chat to 2.3 s.  A process pool would
        isolate the engine fully, at the price of a second copy of the tokenizer
        and the template per process: not worth it while an encoding under the
        byte bound stays that short."""
        raw = await self._body(request)
        try:
            reservation = self.scheduler.reserve()
        except FucinaError as e:
            raise error_of(e) from None
        pending = Pending(asyncio.get_running_loop())
        route = f"{request.method} {request.url.path}"
        try:
            prepared = await run_in_threadpool(self._prepare, kind, raw, reservation,
                                               pending, route)
            return await respond(request, prepared, pending)
        except BaseException:
            pending.cancel()             # a no-op unless a job was submitted
            raise

    def _prepare(self, kind: str, raw: bytes, reservation, pending: Pending,
                 route: str) -> Prepared:
        """(A worker thread.)  Parse, check, render, encode; submit the job in the
        reserved place.  The reservation is released on every way out unless the
        job took it."""
        with reservation:
            prepared = getattr(self, f"_prepare_{kind}")(parse(kind, raw, route))
            job = Job(ids=prepared.ids, text=prepared.text, sampler=prepared.sampler,
                      sink=pending.sink, max_tokens=prepared.max_tokens,
                      stop=prepared.stop)
            try:
                self.scheduler.submit(job, reservation)
            except FucinaError as e:
                raise error_of(e) from None
            pending.job = job
            pending.cancel = lambda: self.scheduler.cancel(job)
        return prepared

    def _sampler(self, config: SamplerConfig, response_format: dict | None,
                 param: str = "response_format") -> Sampler:
        """(A worker thread.)  The request's sampler; a grammar for a JSON schema
        (compiling one can take a while: after every cheaper check)."""
        processor = None
        if response_format is not None and response_format.get("type") != "text":
            try:  # imported here: the server runs without the grammar engine
                from ..grammar import GrammarError, compile_response_format
            except ImportError as e:
                raise ApiError(400, f"structured output is not available: {e}",
                               param=param) from None
            try:
                factory = compile_response_format(response_format, self.tokenizer)
            except GrammarError as e:
                raise ApiError(400, str(e), param=param,
                               code="unsupported_schema") from None
            if factory is not None:
                processor = factory.processor()
        return Sampler(config, logit_processor=processor)

    def _check_bound(self, text: str, param: str) -> None:
        """Refuse a prompt that cannot fit before encoding it: every token spells
        at most `longest_token` bytes (128 in Qwen's vocabulary), so B bytes are
        at least ceil(B / longest_token) tokens.  Costs one UTF-8 encoding; the
        encoder's own cost may grow faster than the text (a quadratic BPE took
        six minutes on 200,000 repeated characters)."""
        size = len(text.encode("utf-8", "surrogatepass"))   # as the tokenizer does
        least = -(-size // self.longest_token)
        room = self.scheduler.capacity
        if not prompt_fits(least, room):
            raise ApiError(400, f"the prompt has at least {least} tokens ({size} "
                           f"bytes, at most {self.longest_token} a token); the context "
                           f"holds {room} positions (at least 1 is needed to answer)",
                           param=param, code="context_length_exceeded")

    def _check_length(self, ids, param: str) -> None:
        if not ids:
            raise ApiError(400, "the prompt is empty", param=param)
        room = self.scheduler.capacity
        if not prompt_fits(len(ids), room):
            raise ApiError(400, f"the prompt has {len(ids)} tokens; the context holds "
                           f"{room} positions (at least 1 is needed to answer)",
                           param=param, code="context_length_exceeded")

    def _encode_chat(self, messages: list[dict], thinking: bool,
                     param: str) -> tuple[str, list[int]]:
        """(A worker thread.)  Render the template, check the bound, encode."""
        try:
            text = self.format.render(messages, no_think=not thinking)
        except FucinaError as e:
            raise ApiError(400, f"the messages cannot be rendered: {e}",
                           param=param) from None
        self._check_bound(text, param)
        ids = self._encode(text, param, raw=True)
        self._check_length(ids, param)
        return text, ids

    def _encode(self, text: str, param: str, *, raw: bool) -> list[int]:
        """(A worker thread.)  Text -> ids; what the tokenizer refuses (a run of
        one character class over its chunk limit) is a 400 naming `param`."""
        try:
            return (self.tokenizer.encode_raw if raw else self.tokenizer.encode)(text)
        except FucinaError as e:
            raise ApiError(400, f"the prompt cannot be encoded: {e}", param=param,
                           code="invalid_value") from None

    def _starts_thinking(self, text: str) -> bool:
        """Did the template open a think block the model is to continue?"""
        tail = text.rstrip("\n")
        return self.format.can_think and tail.endswith(THINK_OPEN)

    # --- /v1/chat/completions -------------------------------------------------------

    async def chat(self, request):
        return await self._serve("chat", request, self._answer_chat)

    def _prepare_chat(self, req) -> Prepared:
        self._check_model(req.model)
        if not req.messages:
            raise ApiError(400, "messages must not be empty", param="messages")
        messages = chat_messages(req.messages)
        thinking = (req.chat_template_kwargs or {}).get("enable_thinking", True)
        if not isinstance(thinking, bool):
            raise ApiError(400, "enable_thinking must be a boolean",
                           param="chat_template_kwargs.enable_thinking")
        limit = max_tokens(req.max_completion_tokens, "max_completion_tokens") \
            if req.max_completion_tokens is not None \
            else max_tokens(req.max_tokens, "max_tokens")
        stop = stop_list(req.stop)
        config = sampler_config(req, self.tokenizer.vocab_size)  # mistakes first
        text, ids = self._encode_chat(messages, thinking, "messages")
        sampler = self._sampler(config, req.response_format)
        return Prepared(req, text, ids, sampler, limit, stop)

    async def _answer_chat(self, request, prep: Prepared, pending: Pending):
        req, meta = prep.req, _meta("chatcmpl", self.model_id)
        split, thinking = self.format.can_think, self._starts_thinking(prep.text)
        if req.stream:
            usage = bool(req.stream_options and req.stream_options.include_usage)
            return EventStream(answers.chat_events(
                pending.events(), meta, len(prep.ids), split=split,
                thinking=thinking, include_usage=usage), pending.cancel)
        reply = await pending.result(request)
        return answers.chat_completion(meta, reply, len(prep.ids), split, thinking)

    # --- /v1/completions -------------------------------------------------------------

    async def completions(self, request):
        return await self._serve("completion", request, self._answer_completion)

    def _prepare_completion(self, req) -> Prepared:
        self._check_model(req.model)
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            if len(prompt) != 1:
                raise ApiError(400, "one prompt per request", param="prompt")
            prompt = prompt[0]
        limit = max_tokens(req.max_tokens, "max_tokens")
        stop = stop_list(req.stop)
        config = sampler_config(req, self.tokenizer.vocab_size)  # mistakes first
        if isinstance(prompt, str):
            self._check_bound(prompt, "prompt")
            text = prompt
            ids = self._encode(prompt, "prompt", raw=False)
            self._check_length(ids, "prompt")
        else:
            self._check_length(prompt, "prompt")   # before a long list is decoded
            vocab = self.tokenizer.vocab_size
            bad = next((i for i in prompt if not 0 <= i < vocab), None)
            if bad is not None:
                raise ApiError(400, f"token id {bad} is outside the vocabulary "
                               f"(0 .. {vocab - 1})", param="prompt",
                               code="invalid_value")
            ids = list(prompt)
            text = self.tokenizer.decode(ids)
        sampler = self._sampler(config, req.response_format)
        return Prepared(req, text, ids, sampler, limit, stop)

    async def _answer_completion(self, request, prep: Prepared, pending: Pending):
        req, meta = prep.req, _meta("cmpl", self.model_id)
        if req.stream:
            usage = bool(req.stream_options and req.stream_options.include_usage)
            return EventStream(answers.completion_events(
                pending.events(), meta, len(prep.ids), include_usage=usage),
                pending.cancel)
        reply = await pending.result(request)
        return answers.text_completion(meta, reply, len(prep.ids))

    # --- /v1/responses -----------------------------------------------------------------

    async def responses(self, request):
        return await self._serve("responses", request, self._answer_responses)

    def _prepare_responses(self, req) -> Prepared:
        self._check_model(req.model)
        messages = response_messages(req)
        limit = max_tokens(req.max_output_tokens, "max_output_tokens")
        stop = stop_list(req.stop)
        response_format = response_format_of(req.text)
        config = sampler_config(req, self.tokenizer.vocab_size)  # mistakes first
        text, ids = self._encode_chat(messages, True, "input")
        sampler = self._sampler(config, response_format, "text.format")
        return Prepared(req, text, ids, sampler, limit, stop)

    async def _answer_responses(self, request, prep: Prepared, pending: Pending):
        state = answers.ResponseState(
            id=f"resp_{uuid.uuid4().hex[:24]}", msg=f"msg_{uuid.uuid4().hex[:24]}",
            created=time.time(), model=self.model_id, req=prep.req,
            split=self.format.can_think, thinking=self._starts_thinking(prep.text),
            n_prompt=len(prep.ids))
        if prep.req.stream:
            return EventStream(answers.response_events(pending.events(), state),
                               pending.cancel)
        reply = await pending.result(request)
        return answers.response_object(state, reply)
