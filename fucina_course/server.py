"""`fucina serve`: an OpenAI-compatible HTTP server over the engine.

Routes, shaped like OpenAI's so the official `openai` client works unmodified:

    GET  /health                 liveness and load (never needs the API key)
    GET  /v1/models[/{id}]       the one model served
    POST /v1/chat/completions    messages -> an answer (SSE stream or one object)
    POST /v1/completions         a raw prompt -> its continuation
    POST /v1/responses           the text subset of the Responses API

FastAPI + uvicorn (ASGI); every request becomes a `scheduler.Job`, decoded by the
one engine thread together with the other running jobs (scheduler.py: continuous
batching and prefix reuse).

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

Every field of OpenAI's documented request bodies is in one table (`FIELDS`):
honoured, accepted as a no-op (it carries no behaviour here), or refused with a
400 naming it unless its value asks for nothing (`n` = 1, `tools` = [], ...).
Fields outside the schema are ignored with a logged warning naming them, as vLLM
does, so a client that relies on one learns why nothing happened.

Browsers: a web page may send requests to a local server (a form, or `fetch` with
`Content-Type: text/plain`, needs no preflight), and DNS rebinding can make an
attacker's name point at 127.0.0.1.  So `_Guard` refuses (403) a request whose
`Origin` is not the server's own or one given with `--cors-origins` (those get
CORS headers and preflight answers), and, on a loopback address, a `Host` that is
not a loopback name or one given with `--allow-hosts` (as Ollama does).  Clients
that send no Origin (curl, the `openai` client) are not affected.

Errors are OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, so the
client raises its own exception classes: 400 for a malformed body, a field of the
wrong type or out of range (the OpenAI API answers 400 to those too, and the client
maps 400 to `BadRequestError`; FastAPI's usual 422 is not used), 401 for a missing
or wrong API key, 404 for an unknown model or route, 413 for a body over the limit,
403 for a browser origin or Host name not allowed, 429 with `Retry-After` when
every slot and the queue are full, 503 while shutting down.  A request that fails
never takes the server down; a failure of the engine's own loop (a bug) stops it
rather than leave it answering 503 forever: `Server.run` raises a `FucinaError`,
which the command prints as its last line (`fucina: error: ...`, status 1) below
the traceback the log shows for the bug.

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
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional, Union

from .errors import ContextFull, FucinaError
from .kv_cache import prompt_fits
from .sampler import InvalidSamplerConfig, Sampler, SamplerConfig
from .scheduler import (Busy, EngineFailed, Job, Scheduler, ShuttingDown,
                        _one_line)
from .text_stream import THINK_OPEN, ThinkSplitter

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
    if isinstance(exc, EngineFailed):
        return ApiError(503, str(exc), type="server_error", code="engine_failed")
    if isinstance(exc, Busy):
        return ApiError(429, str(exc), type="rate_limit_error",
                        code="rate_limit_exceeded",
                        headers={"Retry-After": str(RETRY_AFTER)})
    if isinstance(exc, ContextFull):
        return ApiError(400, str(exc), code="context_length_exceeded")
    return ApiError(500, str(exc), type="server_error")


# --- the request schema: one table -----------------------------------------------

class Rule(NamedTuple):
    """What the server does with one documented field: "honoured" (validated and
    used), "no-op" (accepted: it carries no behaviour here), or "refused" (a 400
    naming it) unless its value is one of `neutral`, the values that ask for
    nothing; `why` ends the refusal's message."""

    kind: str
    neutral: tuple = ()
    why: str = ""


HONOURED, NO_OP = Rule("honoured"), Rule("no-op")


def _refused(*neutral, why: str) -> Rule:
    return Rule("refused", (None, *neutral), why)


_NO_TOOLS = "this server does not call tools"
_NO_STORE = "this server stores nothing; send the whole history in the request"

# Every field of OpenAI's request bodies for the three routes (as the `openai` client
# 3.57's *CreateParams list them, generated from OpenAI's OpenAPI spec; a test keeps
# the two in step), and llama.cpp's extras this server honours.  (name, routes: c = /v1/chat/completions, p = /v1/completions,
# r = /v1/responses) -> rule.  A field absent from a route's rows is outside its
# schema: ignored with a warning.  Decisions where the API leaves room:
# * the sampling extras (top_k, min_p, repeat_penalty, repeat_last_n; and seed,
#   stop, penalties and logit_bias on /v1/responses, which OpenAI's Responses API
#   lacks) are honoured on every route, as llama.cpp's server does; so is
#   response_format on /v1/completions (this server always took it there);
# * no-ops: metadata, user, safety_identifier (no accounts, no abuse tracking);
#   store (nothing is stored, and nothing is needed later: `previous_response_id`
#   is refused); prompt_cache_* (prefix reuse here is automatic and affects speed
#   only); parallel_tool_calls (meaningless without tools, which are refused);
#   stream_options on /v1/responses (its one option, include_obfuscation, pads
#   events against a network side channel: nothing to pad on a local server);
#   image (options for image inputs, which are refused where they appear);
# * neutral values beyond None: n = best_of = 1, logprobs false (chat; on
#   /v1/completions logprobs is a count and 0 still asks for the sampled token's),
#   top_logprobs 0, echo false, suffix "", tools / functions / include / context
#   management [], tool_choice / function_call "none", modalities ["text"],
#   service_tier "auto" / "default" (there is one tier), verbosity "medium" (the
#   API's default), truncation "disabled" (a prompt over the context is a 400,
#   never cut), background false, and empty objects for background_options,
#   reasoning and access_programs.
_TABLE: list[tuple[str, str, Rule]] = [
    # what this server does
    ("model", "cpr", HONOURED),
    ("messages", "c", HONOURED),
    ("prompt", "p", HONOURED),
    ("input", "r", HONOURED),
    ("instructions", "r", HONOURED),
    ("stream", "cpr", HONOURED),
    ("stream_options", "cp", HONOURED),        # include_usage
    ("temperature", "cpr", HONOURED),
    ("top_p", "cpr", HONOURED),
    ("seed", "cpr", HONOURED),
    ("stop", "cpr", HONOURED),
    ("max_tokens", "cp", HONOURED),
    ("max_completion_tokens", "c", HONOURED),
    ("max_output_tokens", "r", HONOURED),
    ("frequency_penalty", "cpr", HONOURED),
    ("presence_penalty", "cpr", HONOURED),
    ("logit_bias", "cpr", HONOURED),
    ("response_format", "cp", HONOURED),
    ("text", "r", HONOURED),                   # text.format (text.verbosity: below)
    ("top_k", "cpr", HONOURED),                # llama.cpp's extras
    ("min_p", "cpr", HONOURED),
    ("repeat_penalty", "cpr", HONOURED),
    ("repeat_last_n", "cpr", HONOURED),
    ("chat_template_kwargs", "c", HONOURED),   # enable_thinking
    # accepted, no behaviour here
    ("user", "cpr", NO_OP),
    ("metadata", "cr", NO_OP),
    ("safety_identifier", "cr", NO_OP),
    ("store", "cr", NO_OP),
    ("prompt_cache_key", "cr", NO_OP),
    ("prompt_cache_options", "cr", NO_OP),
    ("prompt_cache_retention", "cr", NO_OP),
    ("parallel_tool_calls", "cr", NO_OP),
    ("stream_options", "r", NO_OP),
    ("image", "r", NO_OP),
    # refused unless neutral
    ("n", "cp", _refused(1, why="one answer per request (n = 1)")),
    ("best_of", "p", _refused(1, why="one answer per request (best_of = 1)")),
    ("logprobs", "c", _refused(False, why="no log probabilities are returned")),
    ("logprobs", "p", _refused(why="no log probabilities are returned")),
    ("top_logprobs", "cr", _refused(0, why="no log probabilities are returned")),
    ("echo", "p", _refused(False, why="the prompt is not echoed")),
    ("suffix", "p", _refused("", why="no insertion (suffix) mode")),
    ("tools", "cr", _refused([], why=_NO_TOOLS)),
    ("tool_choice", "cr", _refused("none", why=_NO_TOOLS)),
    ("functions", "c", _refused([], why=_NO_TOOLS)),
    ("function_call", "c", _refused("none", why=_NO_TOOLS)),
    ("max_tool_calls", "r", _refused(why=_NO_TOOLS)),
    ("audio", "c", _refused(why="text output only")),
    ("modalities", "c", _refused(["text"], why="text output only")),
    ("prediction", "c", _refused(why="no predicted outputs")),
    ("web_search_options", "c", _refused(why="no web search")),
    ("reasoning_effort", "c", _refused(
        why="no reasoning effort; Qwen3's thinking is switched by "
        "chat_template_kwargs.enable_thinking")),
    ("reasoning", "r", _refused({}, why="no reasoning options")),
    ("verbosity", "c", _refused("medium", why="no verbosity control")),
    ("moderation", "cr", _refused(why="no moderation")),
    ("service_tier", "cr", _refused("auto", "default", why="one service tier")),
    ("background", "r", _refused(False, why="no background responses")),
    ("background_options", "r", _refused({}, why="no background responses")),
    ("conversation", "r", _refused(why=_NO_STORE)),
    ("previous_response_id", "r", _refused(why=_NO_STORE)),
    ("include", "r", _refused([], why="no additional output data")),
    ("prompt", "r", _refused(why="no stored prompt templates")),
    ("truncation", "r", _refused(
        "disabled", why="the input is never truncated (too long is a 400)")),
    ("context_management", "r", _refused([], why="no context management")),
    ("access_programs", "r", _refused({}, why="no access programs")),
]

ROUTES = {"c": "chat", "p": "completion", "r": "responses"}


def _fields() -> dict[str, dict[str, Rule]]:
    out: dict[str, dict[str, Rule]] = {kind: {} for kind in ROUTES.values()}
    for name, routes, rule in _TABLE:
        for letter in routes:
            assert name not in out[ROUTES[letter]], (name, letter)
            out[ROUTES[letter]][name] = rule
    return out


FIELDS = _fields()      # route -> field -> Rule


def _is_neutral(value, neutral: tuple) -> bool:
    """`value` is one of `neutral`, type for type (True is not 1, 1.0 is not 1)."""
    return any(value is n or (type(value) is type(n) and value == n) for n in neutral)


# --- request bodies -------------------------------------------------------------------

def _models():
    """The pydantic models of the request bodies, built on first use (pydantic is
    imported only by the server).  Their fields are exactly the honoured rows of
    `FIELDS` (tests/test_server.py checks)."""
    from pydantic import BaseModel, ConfigDict, FiniteFloat, StrictStr

    class Body(BaseModel):
        # strict: "5" is not an integer, 1 is not a boolean (OpenAI's rules).
        # extra="allow": a nested field outside the schema (a message's `name`)
        # is kept aside, to be named in the "ignored" warning (`_extras`).
        model_config = ConfigDict(strict=True, extra="allow")

    class TextPart(Body):
        type: StrictStr
        text: Optional[StrictStr] = None

    class Message(Body):
        role: StrictStr
        content: Union[StrictStr, list[TextPart], None] = None
        # documented, refused unless empty (App._messages)
        tool_calls: Optional[list] = None
        function_call: Optional[Any] = None
        audio: Optional[Any] = None

    class StreamOptions(Body):
        include_usage: bool = False
        include_obfuscation: Optional[bool] = None     # no-op (see _TABLE)

    class Sampling(Body):
        model: StrictStr
        stream: bool = False
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
        logit_bias: Optional[dict] = None               # checked by _logit_bias

    class Chat(Sampling):
        messages: list[Message]
        stream_options: Optional[StreamOptions] = None
        max_tokens: Optional[int] = None
        max_completion_tokens: Optional[int] = None
        chat_template_kwargs: Optional[dict] = None
        response_format: Optional[dict] = None

    class Completion(Sampling):
        prompt: Union[StrictStr, list[StrictStr], list[int]]
        stream_options: Optional[StreamOptions] = None
        max_tokens: Optional[int] = 16          # OpenAI's default for completions
        response_format: Optional[dict] = None

    class ResponseText(Body):
        format: Optional[dict] = None
        verbosity: Optional[Any] = None         # refused unless "medium"

    class Responses(Sampling):
        input: Union[StrictStr, list[dict]]
        instructions: Optional[StrictStr] = None
        max_output_tokens: Optional[int] = None
        text: Optional[ResponseText] = None

    return dict(chat=Chat, completion=Completion, responses=Responses,
                message=Message)


_MODELS: dict | None = None


def _parse(kind: str, raw: bytes, route: str = ""):
    """(A worker thread.)  A request body -> its pydantic model, by `FIELDS`:
    refused fields are a 400 naming them, no-ops are dropped, fields outside the
    schema are dropped and named in one warning (as vLLM words it)."""
    global _MODELS
    from pydantic import ValidationError

    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as e:     # RecursionError: deep nesting
        raise ApiError(400, f"the request body is not valid JSON: {e}",
                       code="invalid_json") from None
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object")
    if _MODELS is None:
        _MODELS = _models()
    rules, kept, ignored = FIELDS[kind], {}, []
    for name, value in data.items():
        rule = rules.get(name)
        if rule is None:
            ignored.append(name)
        elif rule.kind == "honoured":
            kept[name] = value
        elif rule.kind == "refused" and not _is_neutral(value, rule.neutral):
            raise _unsupported(name, rule)
    try:
        req = _MODELS[kind].model_validate(kept)
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
    ignored += _extras(req)
    if kind == "chat" and req.chat_template_kwargs:      # only enable_thinking is read
        ignored += [f"chat_template_kwargs.{k}" for k in req.chat_template_kwargs
                    if k != "enable_thinking"]
    if ignored:
        log.warning("The following fields were present in the request but ignored: "
                    "%s%s", ", ".join(repr(n)[:80] for n in ignored[:20])
                    + (f" (and {len(ignored) - 20} more)" if len(ignored) > 20 else ""),
                    f" ({route})" if route else "")
    return req


def _unsupported(param: str, rule: Rule) -> "ApiError":
    return ApiError(400, f"Unsupported parameter: '{param}' is not supported by this "
                    f"server ({rule.why}).", param=param, code="unsupported_parameter")


def _extras(model, path: str = "") -> list[str]:
    """The nested fields outside the schema that pydantic kept aside (extra=
    "allow"), by their path: messages[0].name."""
    from pydantic import BaseModel

    out = [f"{path}.{k}" if path else k for k in (model.model_extra or {})]
    for name in type(model).model_fields:
        value, where = getattr(model, name), f"{path}.{name}" if path else name
        if isinstance(value, BaseModel):
            out += _extras(value, where)
        elif isinstance(value, list) and value and isinstance(value[0], BaseModel):
            for i, item in enumerate(value):      # (a list of ids is not walked)
                out += _extras(item, f"{where}[{i}]")
    return out


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


def _sampler_config(req, vocab_size: int) -> SamplerConfig:
    changes = {name: getattr(req, name) for name in (
        "temperature", "top_p", "top_k", "min_p", "repeat_penalty", "repeat_last_n",
        "presence_penalty", "frequency_penalty", "seed") if getattr(req, name) is not None}
    if req.logit_bias:
        changes["logit_bias"] = _logit_bias(req.logit_bias, vocab_size)
    try:
        return SamplerConfig(**changes)
    except InvalidSamplerConfig as e:
        raise ApiError(400, str(e), param=str(e).split()[0],
                       code="invalid_value") from None


def _logit_bias(value: dict, vocab_size: int) -> dict[int, float]:
    """OpenAI's `logit_bias`: {"token id": bias}, JSON keys being strings; each id
    inside the vocabulary, each bias a number in [-100, 100] (OpenAI's range; a
    bias of -100 bans the token, +100 all but forces it)."""
    out = {}
    for key, bias in value.items():
        if not (key.isascii() and key.isdigit()):
            raise ApiError(400, f"logit_bias keys must be token ids (decimal integers "
                           f"as strings), got {key!r:.40}", param="logit_bias",
                           code="invalid_value")
        tid = int(key) if len(key) <= 12 else vocab_size     # int() caps digits
        if tid >= vocab_size:
            raise ApiError(400, f"logit_bias: token id {key:.40} is outside the "
                           f"vocabulary (0 .. {vocab_size - 1})", param="logit_bias",
                           code="invalid_value")
        if (isinstance(bias, bool) or not isinstance(bias, (int, float))
                or not -100 <= bias <= 100):       # NaN fails the comparison too
            raise ApiError(400, f"logit_bias: the bias of token {tid} must be a number "
                           f"in [-100, 100], got {bias!r:.40}", param="logit_bias",
                           code="invalid_value")
        out[tid] = float(bias)
    return out


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


# --- the application ------------------------------------------------------------------

class App:
    """The routes over one `Scheduler`.  `model_id`: the name clients pass as
    `model` (the file's name and stem are accepted too).  `access`: who may call
    from a browser, and under which Host names (`Access`; default: loopback only,
    no other origin)."""

    def __init__(self, scheduler: Scheduler, model_id: str, *,
                 api_key: str | None = None, max_body: int = MAX_BODY,
                 access: "Access | None" = None):
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
        return _Guard(app, self.api_key, self.max_body, self.access)

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

    async def _body(self, request) -> bytes:
        """The raw body, at most `max_body` bytes (a chunked body is counted as it
        arrives); parsing it is `_prepare`'s work, off the event loop."""
        from starlette.requests import ClientDisconnect

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
        from starlette.concurrency import run_in_threadpool

        raw = await self._body(request)
        try:
            reservation = self.scheduler.reserve()
        except FucinaError as e:
            raise _error_of(e) from None
        pending = _Pending(asyncio.get_running_loop())
        route = f"{request.method} {request.url.path}"
        try:
            prepared = await run_in_threadpool(self._prepare, kind, raw, reservation,
                                               pending, route)
            return await respond(request, prepared, pending)
        except BaseException:
            pending.cancel()             # a no-op unless a job was submitted
            raise

    def _prepare(self, kind: str, raw: bytes, reservation, pending: "_Pending",
                 route: str) -> "_Prepared":
        """(A worker thread.)  Parse, check, render, encode; submit the job in the
        reserved place.  The reservation is released on every way out unless the
        job took it."""
        with reservation:
            prepared = getattr(self, f"_prepare_{kind}")(_parse(kind, raw, route))
            job = Job(ids=prepared.ids, text=prepared.text, sampler=prepared.sampler,
                      sink=pending.sink, max_tokens=prepared.max_tokens,
                      stop=prepared.stop)
            try:
                self.scheduler.submit(job, reservation)
            except FucinaError as e:
                raise _error_of(e) from None
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
                from .grammar import GrammarError, compile_response_format
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

    def _prepare_chat(self, req) -> "_Prepared":
        self._check_model(req.model)
        if not req.messages:
            raise ApiError(400, "messages must not be empty", param="messages")
        messages = self._messages(req.messages)
        thinking = (req.chat_template_kwargs or {}).get("enable_thinking", True)
        if not isinstance(thinking, bool):
            raise ApiError(400, "enable_thinking must be a boolean",
                           param="chat_template_kwargs.enable_thinking")
        max_tokens = _max_tokens(req.max_completion_tokens, "max_completion_tokens") \
            if req.max_completion_tokens is not None \
            else _max_tokens(req.max_tokens, "max_tokens")
        stop = _stop_list(req.stop)
        config = _sampler_config(req, self.tokenizer.vocab_size)  # mistakes first
        text, ids = self._encode_chat(messages, thinking, "messages")
        sampler = self._sampler(config, req.response_format)
        return _Prepared(req, text, ids, sampler, max_tokens, stop)

    @staticmethod
    def _messages(items) -> list[dict]:
        messages = []
        for i, m in enumerate(items):
            role = ROLES.get(m.role)
            if role is None:
                raise ApiError(400, f"unsupported role {m.role!r} (use system, user or "
                               f"assistant)", param=f"messages[{i}].role")
            for name in ("tool_calls", "function_call", "audio"):
                if getattr(m, name) not in (None, []):
                    raise _unsupported(f"messages[{i}].{name}", Rule(
                        "refused", why=_NO_TOOLS if name != "audio"
                        else "text output only"))
            messages.append({"role": role,
                             "content": _text_of(m.content, f"messages[{i}]")})
        return messages

    async def _answer_chat(self, request, prep: "_Prepared", pending: "_Pending"):
        req, text = prep.req, prep.text
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
                "usage": _usage(reply, len(prep.ids))}

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
        return await self._serve("completion", request, self._answer_completion)

    def _prepare_completion(self, req) -> "_Prepared":
        self._check_model(req.model)
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            if len(prompt) != 1:
                raise ApiError(400, "one prompt per request", param="prompt")
            prompt = prompt[0]
        max_tokens = _max_tokens(req.max_tokens, "max_tokens")
        stop = _stop_list(req.stop)
        config = _sampler_config(req, self.tokenizer.vocab_size)  # mistakes first
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
        return _Prepared(req, text, ids, sampler, max_tokens, stop)

    async def _answer_completion(self, request, prep: "_Prepared",
                                 pending: "_Pending"):
        req = prep.req
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
                "usage": _usage(reply, len(prep.ids))}

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
        return await self._serve("responses", request, self._answer_responses)

    def _prepare_responses(self, req) -> "_Prepared":
        self._check_model(req.model)
        if req.text is not None and not _is_neutral(req.text.verbosity,
                                                    (None, "medium")):
            raise _unsupported("text.verbosity", Rule(
                "refused", why="no verbosity control"))
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
        stop = _stop_list(req.stop)
        response_format = None
        if req.text is not None and req.text.format is not None:
            fmt = dict(req.text.format)     # the Responses API's spelling
            if fmt.get("type") == "json_schema":
                response_format = {"type": "json_schema", "json_schema": {
                    k: v for k, v in fmt.items() if k in ("name", "schema", "strict")}}
            else:
                response_format = fmt
        config = _sampler_config(req, self.tokenizer.vocab_size)  # mistakes first
        text, ids = self._encode_chat(messages, True, "input")
        sampler = self._sampler(config, response_format, "text.format")
        return _Prepared(req, text, ids, sampler, max_tokens, stop)

    async def _answer_responses(self, request, prep: "_Prepared",
                                pending: "_Pending"):
        req, text = prep.req, prep.text
        state = dict(id=f"resp_{uuid.uuid4().hex[:24]}", msg=f"msg_{uuid.uuid4().hex[:24]}",
                     created=time.time(), req=req, split=self.format.can_think,
                     thinking=self._starts_thinking(text), n_prompt=len(prep.ids))
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
        if item.get("content") is None:
            raise ApiError(400, "content must be a string or a list of text parts",
                           param=f"{where}.content")
        return {"role": role, "content": _text_of(item["content"], where)}

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


@dataclass
class _Prepared:
    """A request made ready in the worker thread: what its job runs, and its body
    (the answer's shape depends on it)."""

    req: Any
    text: str
    ids: list[int]
    sampler: Sampler
    max_tokens: int | None
    stop: list[str]


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

    async def result(self, request, every: float = 0.25):
        """The reply, once the job is done; the job is cancelled if the client goes
        away first (its slot is free at the next step).  The connection is checked
        every `every` seconds whether or not text arrives: checked only when none
        had arrived for that long, a job whose tokens came faster than that ran to
        its end for a client long gone (seen: 94 tokens after the disconnect)."""
        loop = asyncio.get_running_loop()
        check = loop.time() + every
        try:
            while True:
                try:
                    kind, payload = await asyncio.wait_for(
                        self.queue.get(), max(0.0, check - loop.time()))
                except asyncio.TimeoutError:
                    kind = None
                if kind == "done":
                    return payload
                if kind == "error":
                    raise _error_of(payload)
                if loop.time() >= check:
                    if await request.is_disconnected():
                        self.cancel()
                        raise ApiError(499, "client closed the request") from None
                    check = loop.time() + every
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


class Access:
    """Which browser origins may call the server, and which Host names it answers.

    Origins: a request that carries an `Origin` header (a browser, on behalf of a
    page) is refused unless the origin is the server's own (http://127.0.0.1:PORT,
    http://localhost:PORT, http://[::1]:PORT, http://HOST:PORT) or one of
    `cors_origins` ("*": any); those allowed get CORS headers.  Without this, any
    page the user visits may POST to the local server: a `text/plain` body is a
    "simple" request, sent without a preflight, and the server would parse it.

    Hosts (DNS rebinding: an attacker's name that resolves to 127.0.0.1 makes the
    page same-origin with the server): on a loopback address, the `Host` header
    must be a loopback name or address (localhost, *.localhost, 127.x.x.x, [::1];
    any port) or one of `allow_hosts` ("*": any).  On another address (the user
    exposed the port on purpose) Host is checked only if `allow_hosts` is given,
    and then the bound address and the loopback names are allowed too.  Ollama
    keeps the same two rules (OLLAMA_ORIGINS, and its Host check on loopback)."""

    def __init__(self, host: str, port: int, cors_origins=(), allow_hosts=()):
        origins = [normalize_origin(o) for o in cors_origins]
        self.any_origin = "*" in origins
        named = f"[{host}]" if ":" in host else host
        own = {f"http://{h}:{port}" for h in ("127.0.0.1", "localhost", "[::1]",
                                              named.lower())}
        if port == 80:       # a browser leaves the default port out of an Origin
            own |= {o[:-3] for o in own}
        self.origins = frozenset(own | {o for o in origins if o != "*"})
        hosts = [_host_name(h) for h in allow_hosts if h.strip()]   # a port: dropped
        self.any_host = "*" in hosts
        self.hosts = frozenset(hosts) | {host.lower()}
        self.check_host = not self.any_host and (is_loopback(host) or bool(hosts))

    def origin_allowed(self, origin: str) -> bool:
        return self.any_origin or origin.lower().rstrip("/") in self.origins

    def host_allowed(self, value: str | None) -> bool:
        if not self.check_host or value is None:   # HTTP/1.0 may send no Host
            return True
        name = _host_name(value)
        return _loopback_name(name) or name in self.hosts


def normalize_origin(value: str) -> str:
    """An origin as a browser sends it: scheme://host[:port], lower case, no path
    (a trailing slash is dropped); "*" and "null" stay as they are."""
    o = value.strip().lower().rstrip("/")
    if o in ("*", "null"):
        return o
    scheme, sep, rest = o.partition("://")
    if not sep or not scheme.isalpha() or not rest or "/" in rest or "@" in rest:
        raise FucinaError(f"--cors-origins: {value!r} is not an origin "
                          "(scheme://host[:port], e.g. http://localhost:3000, or *)")
    return o


def _host_name(value: str) -> str:
    """A Host header -> the name or address in it, lower case, port dropped."""
    v = value.strip().lower()
    if v.startswith("["):                        # [::1]:8080
        return v[1:v.find("]")] if "]" in v else v
    if v.count(":") == 1:
        v = v.split(":")[0]
    return v.rstrip(".")


def _loopback_name(name: str) -> bool:
    import ipaddress

    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


PREFLIGHT_MAX_AGE = 600      # seconds a browser may cache a preflight's answer


class _Guard:
    """Pure ASGI middleware, before any route runs: the Host and Origin rules
    (`Access`; preflights answered here), the API key (every route but /health),
    and the body size limit by Content-Length (a chunked body is also counted as
    it is read: `App._body`).  Pure ASGI rather than starlette's
    BaseHTTPMiddleware, which wraps streaming responses and gets in the way of
    noticing a disconnect."""

    def __init__(self, app, api_key: str | None, max_body: int, access: Access):
        self.app, self.max_body, self.access = app, max_body, access
        self.key = f"Bearer {api_key}".encode() if api_key else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        host = headers.get(b"host")
        if not self.access.host_allowed(None if host is None
                                        else host.decode("latin-1")):
            return await _send(send, ApiError(
                403, f"Host {host.decode('latin-1')[:100]!r} refused: this server "
                "answers to loopback names only (start it with --allow-hosts NAME "
                "to add one)", code="host_not_allowed"))
        origin = headers.get(b"origin")
        if origin is not None:
            text = origin.decode("latin-1")
            if not self.access.origin_allowed(text):
                return await _send(send, ApiError(
                    403, f"cross-origin request from {text[:100]!r} refused: start the "
                    "server with --cors-origins ORIGIN to allow a web page to call it",
                    code="origin_not_allowed"))
            cors = [(b"access-control-allow-origin", origin), (b"vary", b"Origin")]
            if (scope.get("method") == "OPTIONS"
                    and b"access-control-request-method" in headers):
                return await _preflight(send, cors, headers)
            send = _adding(send, cors + [(b"access-control-expose-headers",
                                          b"Retry-After")])
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


async def _preflight(send, cors: list, headers: dict) -> None:
    """A CORS preflight from an allowed origin: 204, the methods, and the request
    headers the page asked for (Authorization and Content-Type always), so that
    clients sending their own headers (the JavaScript `openai` client's
    x-stainless-*) work; the origin was chosen by the user, so it is trusted."""
    asked = headers.get(b"access-control-request-headers", b"").decode("latin-1")
    names = {"Authorization", "Content-Type"}
    names |= {h.strip() for h in asked.split(",")
              if h.strip() and all(c.isalnum() or c in "-_" for c in h.strip())}
    out = cors[:1] + [
        (b"access-control-allow-methods", b"GET, POST, OPTIONS"),
        (b"access-control-allow-headers", ", ".join(sorted(names)).encode()),
        (b"access-control-max-age", str(PREFLIGHT_MAX_AGE).encode()),
        (b"vary", b"Origin, Access-Control-Request-Method, "
                  b"Access-Control-Request-Headers"),
        (b"content-length", b"0")]
    if headers.get(b"access-control-request-private-network") == b"true":
        out.append((b"access-control-allow-private-network", b"true"))  # Chrome PNA
    await send({"type": "http.response.start", "status": 204, "headers": out})
    await send({"type": "http.response.body", "body": b""})


def _adding(send, extra: list):
    """`send`, with `extra` headers added to the response's start."""
    async def wrapped(message):
        if message["type"] == "http.response.start":
            message = {**message, "headers": list(message.get("headers", [])) + extra}
        await send(message)
    return wrapped


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
    `start()` serves in a background thread (tests, notebooks) until `stop()`.
    `cors_origins`, `allow_hosts`: see `Access`.

    If the engine thread dies (a bug in its loop), uvicorn is told to exit at its
    next tick (0.1 s) and `run()` raises a `FucinaError` saying why: a server that
    cannot answer any more ends its process instead of answering 503 forever."""

    def __init__(self, model, *, model_id: str | None = None, host: str = "127.0.0.1",
                 port: int = 8080, parallel: int = 4, ctx: int | None = None,
                 cache_type: str = "f16", queue_size: int | None = None,
                 api_key: str | None = None, max_body: int = MAX_BODY,
                 prefill_chunk: int = 64, log_level: str = "warning",
                 speculator=None, cors_origins=(), allow_hosts=()):
        import importlib.util

        missing = [m for m in ("fastapi", "uvicorn") if not importlib.util.find_spec(m)]
        if missing:
            raise FucinaError(f"fucina serve needs {' and '.join(missing)}: "
                              "pip install -r requirements.txt")
        cors_origins = [normalize_origin(o) for o in cors_origins]   # before binding
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
        try:
            self.scheduler = Scheduler(model, parallel=parallel, capacity=ctx,
                                       cache_type=cache_type, queue_size=queue_size,
                                       prefill_chunk=prefill_chunk,
                                       speculator=speculator)
            self.access = Access(host, self.port, cors_origins, allow_hosts)
            self.app = App(self.scheduler, model_id or model.path.stem,
                           api_key=api_key, max_body=max_body, access=self.access)
        except BaseException:
            self.socket.close()
            raise
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

            async def on_tick(self, counter: int) -> bool:
                # every 0.1 s: a dead engine thread stops the server
                if scheduler.failure is not None:
                    self.should_exit = True
                return await super().on_tick(counter)

        config = uvicorn.Config(self.app.asgi, log_level=self.log_level,
                                timeout_graceful_shutdown=5, lifespan="off",
                                access_log=False)
        self._uvicorn = Uvicorn(config)
        return self._uvicorn

    def run(self) -> None:
        """Serve until SIGINT or SIGTERM; then cancel what runs and return.  If the
        engine thread failed, raise a `FucinaError` (one line) once uvicorn has
        shut down."""
        server = self._make_uvicorn()
        self.scheduler.start()
        try:
            server.run(sockets=[self.socket])
        finally:
            self.scheduler.shutdown()
            self.scheduler.join(10)
            self.socket.close()
        self.raise_failure()

    def raise_failure(self) -> None:
        """A `FucinaError` if the engine thread died of an error (the log has its
        traceback: it is a bug)."""
        failure = self.scheduler.failure
        if failure is not None:
            raise FucinaError(f"the engine thread failed ({_one_line(failure)}); "
                              "the server stopped")

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


