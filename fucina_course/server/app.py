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
import contextlib
import logging
import time
import uuid
from dataclasses import dataclass, field

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
from . import answers, tools
from .guard import Access, Guard
from .metrics import CONTENT_TYPE, Counted, Metrics
from .messages import chat_messages, response_messages
from .schema import (ApiError, SamplingRequest, error_of, max_tokens, parse,
                     response_format_of, sampler_config, stop_list)
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
    samplers: list[Sampler]           # one per choice (n), each its own job
    max_tokens: int | None
    stop: list[str]
    tool_calls: object = None         # a tools.ToolPlan: <tool_call> blocks are parsed
    logprobs: int | None = None       # alternatives per token (`logprobs_of`)
    pendings: list = field(default_factory=list)    # each choice's job, as submitted


def _json_response(status: int, body: dict, headers: dict | None = None):
    return JSONResponse(body, status_code=status, headers=headers)


def _meta(prefix: str, model_id: str) -> dict:
    """The id, time and model every chat or completion object (and chunk) repeats."""
    return dict(id=f"{prefix}-{uuid.uuid4().hex[:24]}", created=int(time.time()),
                model=model_id)


MAX_CHOICES = 8        # n: each choice is a job, with a slot and a place of its own


def _invalid(param: str, message: str) -> ApiError:
    return ApiError(400, message, param=param, code="invalid_value")


def logprobs_of(req) -> int | None:
    """How many alternatives a request asks for beside each token's logprob (None:
    no logprobs; generation.py says what a logprob is).  Chat: `logprobs: true`,
    and `top_logprobs` 0 .. 20, which needs it; completions: `logprobs` 0 .. 5,
    where 0 still asks for the chosen token's (OpenAI's ranges and rules)."""
    if hasattr(req, "top_logprobs"):                                 # chat
        top = req.top_logprobs
        if top is not None and not 0 <= top <= 20:
            raise _invalid("top_logprobs",
                           f"top_logprobs must be in 0 .. 20, got {top}")
        if top and not req.logprobs:
            raise _invalid("top_logprobs", "top_logprobs needs logprobs: true")
        return (top or 0) if req.logprobs else None
    value = getattr(req, "logprobs", None)                           # completions
    if value is not None and not 0 <= value <= 5:
        raise _invalid("logprobs", f"logprobs must be in 0 .. 5, got {value}")
    return value


def choice_configs(req, config: SamplerConfig, parallel: int) -> list[SamplerConfig]:
    """The sampler settings of each of the request's `n` choices, after checking n
    (1 .. MAX_CHOICES, and at most `parallel`: the choices run side by side, a slot
    each, and share one prefill: scheduler.py) and the logprobs fields.  With a
    seed, choice i draws from seed + i (mod 2**32): the same n answers each time,
    choice 0 the answer n = 1 gives; without one, each draws a seed of its own."""
    n = getattr(req, "n", None)
    n = 1 if n is None else n
    if not 1 <= n <= MAX_CHOICES:
        raise _invalid("n", f"n must be in 1 .. {MAX_CHOICES}, got {n}")
    if n > parallel:
        raise _invalid("n", f"n = {n} choices run side by side, a slot each, and this "
                       f"server has {parallel} slots (--parallel)")
    logprobs_of(req)
    if config.seed is None:
        return [config] * n
    return [config.with_(seed=(config.seed + i) % 2**32) for i in range(n)]


def _one(streams: list):
    """The event stream of a request's choices: the one's, or n merged."""
    return streams[0] if len(streams) == 1 else answers.merged(streams)


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
        self.metrics = Metrics(scheduler)
        app = self._build()
        # every answer counted (metrics.py); /metrics, like /health, needs no key
        # (a scraper has none): the same routes behind a Guard without it
        keyless = Guard(app, None, self.max_body, self.access)
        self.asgi = Counted(self.metrics, app.router.routes,
                            Guard(app, self.api_key, self.max_body, self.access),
                            by_path={"/metrics": keyless})

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
            return _json_response(exc.status_code, ApiError(   # 405: its Allow header
                exc.status_code, message, code=None).body(), exc.headers)

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
        route("/metrics", self.metrics_text, "GET")
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

    async def metrics_text(self, request):
        """Prometheus' text format (metrics.py), on the event loop: a copy of
        the counters, the scheduler's lock held as briefly as for /health."""
        return Response(self.metrics.render(), media_type=CONTENT_TYPE)

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
        arrival = time.perf_counter()    # the time to first token starts here
        raw = await self._body(request)
        try:
            reservation = self.scheduler.reserve()
        except FucinaError as e:
            raise error_of(e) from None
        pending = Pending(asyncio.get_running_loop())
        route = f"{request.method} {request.url.path}"
        try:
            prepared = await run_in_threadpool(self._prepare, kind, raw, reservation,
                                               pending, route, arrival)
            return await respond(request, prepared, pending)
        except BaseException:
            pending.cancel()             # a no-op unless a job was submitted
            raise

    def _prepare(self, kind: str, raw: bytes, reservation, pending: Pending,
                 route: str, arrival: float) -> Prepared:
        """(A worker thread.)  Parse, check, render, encode; submit the job in the
        reserved place (n choices: n jobs of one group, each in a place of its own,
        reserved here: a 429 if they are not free).  Every place is released on
        every way out unless a job took it."""
        with reservation, contextlib.ExitStack() as places:
            prepared = getattr(self, f"_prepare_{kind}")(parse(kind, raw, route))
            n = len(prepared.samplers)
            held = [reservation] + [places.enter_context(self._place(n))
                                    for _ in range(n - 1)]
            prepared.logprobs = logprobs_of(prepared.req)
            prepared.pendings = [pending] + [Pending(pending.loop)
                                             for _ in range(n - 1)]
            group = object() if n > 1 else None
            jobs = [Job(ids=prepared.ids, text=prepared.text, sampler=sampler,
                        sink=self.metrics.watch(p.sink, arrival, prompt=i == 0),
                        max_tokens=prepared.max_tokens, stop=prepared.stop,
                        logprobs=prepared.logprobs, group=group)
                    for i, (sampler, p) in enumerate(zip(prepared.samplers,
                                                         prepared.pendings))]
            submitted: list[Job] = []

            def cancel() -> None:            # every choice goes with the request
                for job in submitted:
                    self.scheduler.cancel(job)

            try:
                for job, place in zip(jobs, held):
                    self.scheduler.submit(job, place)
                    submitted.append(job)
            except FucinaError as e:
                cancel()
                raise error_of(e) from None
            for p, job in zip(prepared.pendings, jobs):
                p.job, p.cancel = job, cancel
        return prepared

    def _place(self, n: int):
        """(A worker thread.)  One more place in the load for a request of n
        choices (`Scheduler.reserve`); the error says why it needs several."""
        try:
            return self.scheduler.reserve()
        except FucinaError as e:
            err = error_of(e)
            err.message = f"n = {n} choices take {n} places in the load: {err.message}"
            raise err from None

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

    def _encode_chat(self, messages: list[dict], thinking: bool, param: str,
                     tools: list[dict] | None = None) -> tuple[str, list[int]]:
        """(A worker thread.)  Render the template, check the bound, encode."""
        try:
            text = self.format.render(messages, no_think=not thinking, tools=tools)
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

    def _think_close(self, text: str) -> int | None:
        """`</think>`'s id if the rendered prompt left the model thinking."""
        return self.format.think_ids[1] if self._starts_thinking(text) else None

    def _starts_thinking(self, text: str) -> bool:
        """Did the template open a think block the model is to continue?"""
        tail = text.rstrip("\n")
        return self.format.can_think and tail.endswith(THINK_OPEN)

    def _spell(self, tid: int) -> bytes:
        """A token's bytes, as a logprob entry lists them (an id of the
        vocabulary's padding, past the tokenizer's list, spells nothing)."""
        spelled = self.tokenizer.token_bytes
        return spelled[tid] if 0 <= tid < len(spelled) else b""

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
        configs = choice_configs(req, config, self.scheduler.parallel)
        plan = tools.plan(req, self.tokenizer)
        text, ids = self._encode_chat(messages, thinking, "messages",
                                      plan.entries if plan else None)
        if plan is not None:
            close = self._think_close(text)
            samplers = [Sampler(c, logit_processor=plan.processor(close))
                        for c in configs]
            return Prepared(req, text, ids, samplers, limit, stop, tool_calls=plan)
        samplers = [self._sampler(c, req.response_format) for c in configs]
        return Prepared(req, text, ids, samplers, limit, stop)

    async def _answer_chat(self, request, prep: Prepared, pending: Pending):
        req, meta = prep.req, _meta("chatcmpl", self.model_id)
        split, thinking = self.format.can_think, self._starts_thinking(prep.text)
        if req.stream:
            usage = bool(req.stream_options and req.stream_options.include_usage)
            streams = []
            for i, p in enumerate(prep.pendings):       # a stream per choice
                events = answers.chat_events(
                    p.events(), meta, len(prep.ids), split=split,
                    thinking=thinking, include_usage=usage,
                    think_ids=self.format.think_ids, index=i,
                    spell=self._spell if prep.logprobs is not None else None)
                if prep.tool_calls:
                    events = tools.tool_events(events)
                streams.append(events)
            return EventStream(_one(streams), pending.cancel)
        bodies = []
        for p in prep.pendings:
            reply = await p.result(request)
            body = answers.chat_completion(meta, reply, len(prep.ids), split, thinking,
                                           self.format.think_ids)
            body["choices"][0]["logprobs"] = answers.chat_logprobs(reply.logprobs,
                                                                   self._spell)
            bodies.append(tools.tool_message(body) if prep.tool_calls else body)
        return answers.several(bodies)

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
        configs = choice_configs(req, config, self.scheduler.parallel)
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
        samplers = [self._sampler(c, req.response_format) for c in configs]
        return Prepared(req, text, ids, samplers, limit, stop)

    async def _answer_completion(self, request, prep: Prepared, pending: Pending):
        req, meta = prep.req, _meta("cmpl", self.model_id)
        spell = self._spell if prep.logprobs is not None else None
        if req.stream:
            usage = bool(req.stream_options and req.stream_options.include_usage)
            return EventStream(_one([answers.completion_events(
                p.events(), meta, len(prep.ids), include_usage=usage, index=i,
                spell=spell, offset=len(prep.text))
                for i, p in enumerate(prep.pendings)]), pending.cancel)
        bodies = []
        for p in prep.pendings:
            reply = await p.result(request)
            body = answers.text_completion(meta, reply, len(prep.ids))
            body["choices"][0]["logprobs"] = answers.completion_logprobs(
                reply.logprobs, self._spell, len(prep.text))
            bodies.append(body)
        return answers.several(bodies)

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
        plan = tools.plan(req, self.tokenizer)
        text, ids = self._encode_chat(messages, True, "input",
                                      plan.entries if plan else None)
        if plan is not None:
            sampler = Sampler(config, logit_processor=plan.processor(
                self._think_close(text)))
            return Prepared(req, text, ids, [sampler], limit, stop, tool_calls=plan)
        sampler = self._sampler(config, response_format, "text.format")
        return Prepared(req, text, ids, [sampler], limit, stop)

    async def _answer_responses(self, request, prep: Prepared, pending: Pending):
        state = answers.ResponseState(
            id=f"resp_{uuid.uuid4().hex[:24]}", msg=f"msg_{uuid.uuid4().hex[:24]}",
            created=time.time(), model=self.model_id, req=prep.req,
            split=self.format.can_think, thinking=self._starts_thinking(prep.text),
            n_prompt=len(prep.ids), think_ids=self.format.think_ids)
        if prep.req.stream:
            events = answers.response_events(pending.events(), state)
            if prep.tool_calls:
                events = tools.ResponseToolEvents(prep.tool_calls).run(events)
            return EventStream(events, pending.cancel)
        reply = await pending.result(request)
        body = answers.response_object(state, reply)
        return tools.tool_response(body, prep.tool_calls) if prep.tool_calls else body
