"""The OpenAI request schema, as this server reads it: one table, pydantic models,
and the errors' shape.  Pure: nothing here touches HTTP, so all of it can be tested
by calling it.

Every field of OpenAI's documented request bodies is in one table (`FIELDS`):
honoured, accepted as a no-op (it carries no behaviour here), or refused with a
400 naming it unless its value asks for nothing (`n` = 1, `tools` = [], ...).
Fields outside the schema are ignored with a logged warning naming them, as vLLM
does, so a client that relies on one learns why nothing happened.  The request
models hold exactly the honoured rows (tests/test_server.py checks), so the table
is the one place that says what a field does.

Errors are OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`
(`ErrorBody`), so the client raises its own exception classes: 400 for a malformed
body, a field of the wrong type or out of range (the OpenAI API answers 400 to
those too, and the client maps 400 to `BadRequestError`; FastAPI's usual 422 is not
used: the bodies are validated here, not by FastAPI), 401 for a missing or wrong
API key, 404 for an unknown model or route, 413 for a body over the limit, 403 for
a browser origin or Host name not allowed, 429 with `Retry-After` when every slot
and the queue are full, 503 while shutting down.

Sampling defaults are llama.cpp's server's (`SamplerConfig()`: temperature 0.8,
top-k 40, top-p 0.95, min-p 0.05), not OpenAI's temperature 1: a client that sets
nothing gets what it would get from llama-server on the same GGUF.

pydantic is imported at module level: only `fucina serve` imports this package
(the engine, the CLI's other commands and the book run without the `serve` extra:
tests/test_packaging.py), so the models need no factory that builds them on first
use.
"""

from __future__ import annotations

import json
import logging
from typing import Any, NamedTuple, Optional, Union

from pydantic import (BaseModel, ConfigDict, FiniteFloat, StrictStr,
                      ValidationError)

from ..errors import ContextFull, FucinaError
from ..sampler import InvalidSamplerConfig, SamplerConfig
from ..scheduler import Busy, EngineFailed, ShuttingDown

log = logging.getLogger("fucina.serve")

RETRY_AFTER = 1        # seconds a 429 asks the client to wait (a decode step is ~0.1 s)


# --- errors -------------------------------------------------------------------------

class ErrorDetail(BaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[str] = None


class ErrorBody(BaseModel):
    """OpenAI's error body: what every failed request is answered, on every route."""

    error: ErrorDetail


class ApiError(Exception):
    """An error answer in OpenAI's shape."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code, self.headers = param, code, headers or {}

    def body(self) -> dict:
        return ErrorBody(error=ErrorDetail(message=self.message, type=self.type,
                                           param=self.param, code=self.code)).model_dump()


def error_of(exc: FucinaError) -> ApiError:
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


USE_TOOLS = "the deprecated functions API is not served; send tools"
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
#   only);
#   stream_options on /v1/responses (its one option, include_obfuscation, pads
#   events against a network side channel: nothing to pad on a local server);
#   image (options for image inputs, which are refused where they appear);
# * n (choice i seeded seed + i), logprobs, top_logprobs: app.py, generation.py;
# * neutral values beyond None: best_of = 1, top_logprobs 0 (/v1/responses),
#   echo false, suffix "", tools / functions / include / context
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
    ("n", "cp", HONOURED),                     # 1 .. 8, at most --parallel (app.py)
    ("logprobs", "cp", HONOURED),              # chat: bool; completions: 0 .. 5
    ("top_logprobs", "c", HONOURED),           # 0 .. 20, with logprobs: true
    ("response_format", "cp", HONOURED),
    ("text", "r", HONOURED),                   # text.format (text.verbosity: below)
    ("top_k", "cpr", HONOURED),                # llama.cpp's extras
    ("min_p", "cpr", HONOURED),
    ("repeat_penalty", "cpr", HONOURED),
    ("repeat_last_n", "cpr", HONOURED),
    ("chat_template_kwargs", "c", HONOURED),   # enable_thinking
    ("tools", "cr", HONOURED),                 # server/tools.py
    ("tool_choice", "cr", HONOURED),
    ("parallel_tool_calls", "cr", HONOURED),
    # accepted, no behaviour here
    ("user", "cpr", NO_OP),
    ("metadata", "cr", NO_OP),
    ("safety_identifier", "cr", NO_OP),
    ("store", "cr", NO_OP),
    ("prompt_cache_key", "cr", NO_OP),
    ("prompt_cache_options", "cr", NO_OP),
    ("prompt_cache_retention", "cr", NO_OP),
    ("stream_options", "r", NO_OP),
    ("image", "r", NO_OP),
    # refused unless neutral
    ("best_of", "p", _refused(1, why="no best-of ranking (best_of = 1; n is served)")),
    ("top_logprobs", "r", _refused(0, why="no log probabilities on this route")),
    ("echo", "p", _refused(False, why="the prompt is not echoed")),
    ("suffix", "p", _refused("", why="no insertion (suffix) mode")),
    ("functions", "c", _refused([], why=USE_TOOLS)),
    ("function_call", "c", _refused("none", why=USE_TOOLS)),
    ("max_tool_calls", "r", _refused(
        why="no cap on tool calls; parallel_tool_calls false asks for one")),
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


def is_neutral(value, neutral: tuple) -> bool:
    """`value` is one of `neutral`, type for type (True is not 1, 1.0 is not 1)."""
    return any(value is n or (type(value) is type(n) and value == n) for n in neutral)


def unsupported(param: str, rule: Rule) -> ApiError:
    return ApiError(400, f"Unsupported parameter: '{param}' is not supported by this "
                    f"server ({rule.why}).", param=param, code="unsupported_parameter")


# --- request bodies: their fields are exactly the honoured rows of FIELDS ----------------

class RequestBody(BaseModel):
    # strict: "5" is not an integer, 1 is not a boolean (OpenAI's rules).
    # extra="allow": a nested field outside the schema (a message's `name`)
    # is kept aside, to be named in the "ignored" warning (`_extras`).
    model_config = ConfigDict(strict=True, extra="allow")


class TextPart(RequestBody):
    type: StrictStr
    text: Optional[StrictStr] = None


class Message(RequestBody):
    role: StrictStr
    content: Union[StrictStr, list[TextPart], None] = None
    tool_calls: Optional[list] = None            # an assistant's calls (server/tools.py)
    tool_call_id: Optional[StrictStr] = None     # a tool message: the call it answers
    # documented, refused unless empty (`chat_messages`)
    function_call: Optional[Any] = None
    audio: Optional[Any] = None


class StreamOptions(RequestBody):
    include_usage: bool = False
    include_obfuscation: Optional[bool] = None     # no-op (see _TABLE)


class SamplingRequest(RequestBody):
    """The fields every route shares: the model's name, streaming, the sampler."""

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


class ChatRequest(SamplingRequest):
    messages: list[Message]
    stream_options: Optional[StreamOptions] = None
    max_tokens: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    chat_template_kwargs: Optional[dict] = None
    response_format: Optional[dict] = None
    n: Optional[int] = None                      # checked by app.choice_configs
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = None
    tools: Optional[list] = None                 # checked by tool_calls.tools_of
    tool_choice: Union[StrictStr, dict, None] = None
    parallel_tool_calls: Optional[bool] = None


class CompletionRequest(SamplingRequest):
    prompt: Union[StrictStr, list[StrictStr], list[int]]
    stream_options: Optional[StreamOptions] = None
    max_tokens: Optional[int] = 16          # OpenAI's default for completions
    response_format: Optional[dict] = None
    n: Optional[int] = None                 # checked by app.choice_configs
    logprobs: Optional[int] = None          # 0 .. 5 alternatives


class ResponseText(RequestBody):
    format: Optional[dict] = None
    verbosity: Optional[Any] = None         # refused unless "medium"


class ResponsesRequest(SamplingRequest):
    input: Union[StrictStr, list[dict]]
    instructions: Optional[StrictStr] = None
    max_output_tokens: Optional[int] = None
    text: Optional[ResponseText] = None
    tools: Optional[list] = None                 # function tools (server/tools.py)
    tool_choice: Union[StrictStr, dict, None] = None
    parallel_tool_calls: Optional[bool] = None

    @property
    def response_format(self) -> dict | None:
        return response_format_of(self.text)


REQUESTS: dict[str, type[SamplingRequest]] = {
    "chat": ChatRequest, "completion": CompletionRequest, "responses": ResponsesRequest}


def parse(kind: str, raw: bytes, route: str = "") -> SamplingRequest:
    """(A worker thread.)  A request body -> its pydantic model, by `FIELDS`:
    refused fields are a 400 naming them, no-ops are dropped, fields outside the
    schema are dropped and named in one warning (as vLLM words it)."""
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as e:     # RecursionError: deep nesting
        raise ApiError(400, f"the request body is not valid JSON: {e}",
                       code="invalid_json") from None
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object")
    rules, kept, ignored = FIELDS[kind], {}, []
    for name, value in data.items():
        rule = rules.get(name)
        if rule is None:
            ignored.append(name)
        elif rule.kind == "honoured":
            kept[name] = value
        elif rule.kind == "refused" and not is_neutral(value, rule.neutral):
            raise unsupported(name, rule)
    try:
        req = REQUESTS[kind].model_validate(kept)
    except ValidationError as e:
        raise _invalid(e) from None
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


def _invalid(e: ValidationError) -> ApiError:
    """pydantic's first complaint -> OpenAI's 400, naming the parameter."""
    first = e.errors()[0]
    param = _param(first.get("loc", ()))
    kind = first.get("type", "")
    if kind == "missing":
        message = f"Missing required parameter: '{param}'."
    else:
        message = f"Invalid value for '{param}': {first.get('msg')}."
    return ApiError(400, message, param=param,
                    code="missing_required_parameter" if kind == "missing"
                    else "invalid_type")


def _extras(model: BaseModel, path: str = "") -> list[str]:
    """The nested fields outside the schema that pydantic kept aside (extra=
    "allow"), by their path: messages[0].name."""
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


# --- the fields' values -----------------------------------------------------------------

def sampler_config(req: SamplingRequest, vocab_size: int) -> SamplerConfig:
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


def stop_list(stop) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else list(stop)
    if len(stops) > 4:
        raise ApiError(400, "at most 4 stop sequences", param="stop")
    return [s for s in stops if s]


def max_tokens(value, param: str) -> int | None:
    if value is not None and value < 1:
        raise ApiError(400, f"{param} must be at least 1, got {value}", param=param,
                       code="invalid_value")
    return value


def response_format_of(text: ResponseText | None) -> dict | None:
    """The Responses API's `text.format` -> chat's `response_format` spelling."""
    if text is None or text.format is None:
        return None
    fmt = dict(text.format)
    if fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {
            k: v for k, v in fmt.items() if k in ("name", "schema", "strict")}}
    return fmt
