"""The process: a scheduler, the app, and uvicorn on a socket, started and stopped
(`Server`), with the signals that end it.

Signals: SIGINT or SIGTERM cancel the running requests first (the scheduler shuts
down, so every stream ends now with its reason instead of the graceful shutdown
waiting for whole answers), then uvicorn exits; a second SIGINT forces it.  The
signal is not recorded: uvicorn re-raises recorded signals after shutting down,
which would turn a clean exit (status 0) into death by SIGTERM, or a
KeyboardInterrupt traceback.

A failure of the engine's own loop (a bug) stops the process rather than leave it
answering 503 forever: uvicorn is told to exit at its next tick (0.1 s), and
`Server.run` raises a `FucinaError`, which the command prints as its last line
(`fucina: error: ...`, status 1) below the traceback the log shows for the bug.
"""

from __future__ import annotations

import signal
import socket
import threading
import time

import uvicorn

from ..errors import FucinaError
from ..scheduler import Scheduler, _one_line
from .app import MAX_BODY, App
from .guard import Access, normalize_origin
from .stream import SHUTDOWN_GRACE

GRACEFUL_SHUTDOWN = 5   # seconds uvicorn waits for open connections when it exits
assert SHUTDOWN_GRACE < GRACEFUL_SHUTDOWN   # streams end before uvicorn gives up


class _Uvicorn(uvicorn.Server):
    """uvicorn, with the scheduler's part in its exit (see the module's docstring)."""

    def __init__(self, config: uvicorn.Config, scheduler: Scheduler):
        super().__init__(config)
        self.scheduler = scheduler

    def handle_exit(self, sig, frame):
        # Cancel the running requests first, and do not record the signal.  Nor
        # call the base method: importing sse_starlette patches it to set
        # `AppStatus.should_exit`, a process-wide flag never reset, which would
        # cut at once every stream of every later server in this process (the
        # tests run many).  sse-starlette finds this server's own `should_exit`
        # through the signal handler (`fucina serve`: the main thread), and the
        # streams end by themselves anyway once their jobs are cancelled.
        self.scheduler.shutdown()
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        else:
            self.should_exit = True

    async def on_tick(self, counter: int) -> bool:
        # every 0.1 s: a dead engine thread stops the server
        if self.scheduler.failure is not None:
            self.should_exit = True
        return await super().on_tick(counter)


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
        self._uvicorn: _Uvicorn | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def _make_uvicorn(self) -> _Uvicorn:
        config = uvicorn.Config(self.app.asgi, log_level=self.log_level,
                                timeout_graceful_shutdown=GRACEFUL_SHUTDOWN,
                                lifespan="off", access_log=False)
        self._uvicorn = _Uvicorn(config, self.scheduler)
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
