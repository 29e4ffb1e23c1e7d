"""`fucina serve`: an OpenAI-compatible HTTP server over the engine.

Routes, shaped like OpenAI's so the official `openai` client works unmodified:

    GET  /health                 liveness and load (never needs the API key)
    GET  /metrics                Prometheus text format (never needs the API key)
    GET  /v1/models[/{id}]       the one model served
    POST /v1/chat/completions    messages -> an answer (SSE stream or one object)
    POST /v1/completions         a raw prompt -> its continuation
    POST /v1/responses           the text subset of the Responses API, function tools

FastAPI + uvicorn (ASGI); every request becomes a `scheduler.Job`, decoded by the
one engine thread together with the other running jobs.  The package, from the
wire inwards:

    process.py   `Server`: the socket, uvicorn, the signals that stop it
    guard.py     who may call: Origin and Host rules, the API key, the body limit
    app.py       `App`: the routes; a body is read, reserved a place, prepared
                 off the event loop and submitted as a job
    stream.py    a job's events to the socket: server-sent events (sse-starlette),
                 cancelled the moment the client goes away
    answers.py   OpenAI's response objects and stream events, from a job's reply
    tools.py     tool calls: the model's <tool_call> blocks as `tool_calls` (chat)
                 and `function_call` items (responses), streamed or whole
    metrics.py   /metrics: answers by route and status, tokens, load, latencies
    messages.py  a request's messages (tool calls and results too) -> the template's
    schema.py    OpenAI's request bodies (one table of every field, pydantic
                 models) and its error shape

Only `fucina serve` imports this package, and the `serve` extra's modules
(fastapi, starlette, pydantic, sse-starlette, uvicorn) are imported at the top of
its modules: the engine and the rest of the CLI never import it, and run without
that extra (tests/test_packaging.py).
"""

from .app import MAX_BODY, App
from .guard import Access, is_loopback, normalize_origin
from .process import Server
from .schema import FIELDS, REQUESTS, ApiError, Rule

__all__ = ["MAX_BODY", "App", "Access", "is_loopback", "normalize_origin", "Server",
           "FIELDS", "REQUESTS", "ApiError", "Rule"]
