"""From the engine thread to the socket: a submitted job as the event loop sees it
(`Pending`), and the server-sent-events response that streams it (`EventStream`).

The invariant: a client that goes away stops its job at once, so its slot is free
at the next decode step, whether it was reading a stream or waiting for a whole
answer.

Streams use sse-starlette's `EventSourceResponse`, which runs the stream, a
keep-alive ping and a listener for the connection's `http.disconnect` in one task
group: the disconnect is seen when it happens, not at the next write (starlette's
`StreamingResponse` notices it only when a write fails, i.e. at the next token on
ASGI 2.4: the job would run on, holding a slot).  `EventStream` adds what that
class leaves to the application: the job is cancelled the moment the disconnect
arrives, and again (a no-op if it is over) whenever the response ends, however it
ends.  It replaced a hand-written `StreamingResponse` subclass that raced
`http.disconnect` itself and framed the events by hand.

What is kept as it was: the events' bytes (`data: {json}` and a blank line, "\\n"
separators, not sse-starlette's default "\\r\\n"), and the headers
(Cache-Control: no-cache, X-Accel-Buffering: no; sse-starlette's own
`Connection: keep-alive` is dropped: a hop-by-hop header is the HTTP server's
business, and HTTP/2 forbids it).  What is added: a comment line (`: ping - <time>`)
every `PING_SECONDS` while nothing else is sent, e.g. while a request waits in the
queue, so that a proxy does not close an idle stream; SSE clients skip comments
(the `openai` client's decoder does).  At shutdown sse-starlette cancels open
streams once uvicorn is exiting; `SHUTDOWN_GRACE` lets them end on their own first:
the scheduler has already cancelled their jobs, so each ends with its error event
(the reason) instead of being cut off mid-stream.

A request that is not streamed is cancelled by `Pending.result`, which checks the
connection every 0.25 s while it waits.
"""

from __future__ import annotations

import asyncio

from sse_starlette.sse import EventSourceResponse

from ..scheduler import Job
from .schema import ApiError, error_of

SSE_SEPARATOR = "\n"
PING_SECONDS = 15       # a comment line this often while a stream sends nothing
SHUTDOWN_GRACE = 3      # seconds a stream may take to end at shutdown (under
                        # uvicorn's graceful timeout, process.GRACEFUL_SHUTDOWN)
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class Pending:
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
                    raise error_of(payload)
                if loop.time() >= check:
                    if await request.is_disconnected():
                        self.cancel()
                        raise ApiError(499, "client closed the request") from None
                    check = loop.time() + every
        finally:
            if self.job is not None and not self.job.over:
                self.cancel()


class EventStream(EventSourceResponse):
    """The events of `content` (sse-starlette's event dicts) as a
    text/event-stream; `on_close()` (cancel the job) when the client disconnects
    and whenever the response ends."""

    def __init__(self, content, on_close):
        async def closed(message):          # the http.disconnect, as it arrives
            on_close()

        super().__init__(content, headers=HEADERS, sep=SSE_SEPARATOR,
                         ping=PING_SECONDS, shutdown_grace_period=SHUTDOWN_GRACE,
                         client_close_handler_callable=closed)
        del self.headers["connection"]
        self.on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        except OSError:                     # the socket went first: nobody to tell
            pass
        finally:
            self.on_close()
