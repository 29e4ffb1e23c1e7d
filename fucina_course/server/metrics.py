"""`GET /metrics`: what the server did, in Prometheus' text exposition format
(version 0.0.4), written here: the format is a few lines per metric, and the
server needs no client library for it (the tests parse it with
`prometheus_client`'s parser).

Who writes what, and when:

    `Counted`   (pure ASGI, outside everything, on the event loop) counts every
                answer sent, by route template and status code, the Guard's
                401/403/413 and the 429s included; a streamed answer once
                (its status line).
    `Metrics.watch`   wraps a job's sink (called by the engine thread): the time
                to its first text, and its reply's token counts.
    `Metrics.render`  (on the event loop, per scrape) reads the scheduler's
                `snapshot()` (its lock, briefly, as /health does) and its own
                counters (a copy under its own lock).

The one lock here is held for a few additions or a copy (microseconds), so the
engine thread never waits on a scrape.  The metrics never stop an event: a
failure while observing one is logged, and the event goes on to the client.

The metrics (prefix `fucina_`):

    requests_total{route,status}   answers sent; `route` is the route's path
                                   template ("/v1/models/{name:path}"), or
                                   "unmatched" (a 404 for an unknown path), so
                                   a client cannot grow the label set
    prompt_tokens_total            usage.prompt_tokens of every request that
                                   finished with a reply (n choices: once)
    generated_tokens_total         usage.completion_tokens of those replies
                                   (every sampled token, the end marker too)
    prefilled_tokens_total         the scheduler's Stats: prompt ids run
                                   through the model, of every job that got a
                                   slot (cancelled ones too)
    prefix_cache_reused_tokens_total   prompt ids found in a slot's cache
    jobs_started_total, jobs_rejected_total (Busy: 429),
    jobs_cancelled_total, decode_steps_total, decode_rows_total,
    speculation_drafted_tokens_total, speculation_accepted_tokens_total
    queue_waiting, slots_busy, slots, requests_preparing, engine_up  (gauges)
    time_to_first_token_seconds    histogram (`TTFT_BUCKETS`; `Metrics.watch`
                                   defines it)
    time_per_output_token_seconds  histogram (`TOKEN_BUCKETS`; `Metrics.watch`)
"""

from __future__ import annotations

import logging
import math
import threading
import time
from bisect import bisect_left

from starlette.routing import Match

from .answers import sampled

log = logging.getLogger("fucina.serve")

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# A CPU engine: a short prompt's first token in ~0.1 s on the default model, a
# long one (or a full queue) in tens of seconds; a decode step from ~20 ms (0.5B,
# one job) to ~1 s (an 8B model, or a step shared with prefill chunks).
TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0)
TOKEN_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.0)

# the scheduler's counters (`Stats`, through `snapshot()`): key, name, help
ENGINE_COUNTERS = (
    ("prefilled", "fucina_prefilled_tokens_total",
     "Prompt tokens run through the model (prefill), every job that got a slot."),
    ("reused", "fucina_prefix_cache_reused_tokens_total",
     "Prompt tokens found in a slot's cache (prefix reuse), not prefilled again."),
    ("jobs", "fucina_jobs_started_total", "Jobs that got a slot."),
    ("rejected", "fucina_jobs_rejected_total",
     "Requests refused because every slot and queue place was taken (429)."),
    ("cancelled", "fucina_jobs_cancelled_total",
     "Jobs cancelled (the client went away, or the server shut down)."),
    ("steps", "fucina_decode_steps_total",
     "Decode steps (one forward pass for all running jobs)."),
    ("rows", "fucina_decode_rows_total",
     "Decode rows over all steps (speculation's verify rows included)."),
    ("drafted", "fucina_speculation_drafted_tokens_total",
     "Speculation: drafted tokens checked."),
    ("accepted", "fucina_speculation_accepted_tokens_total",
     "Speculation: drafted tokens the model agreed with."),
)
# gauges from the same snapshot: key, name, help
ENGINE_GAUGES = (
    ("waiting", "fucina_queue_waiting", "Jobs waiting for a slot."),
    ("busy", "fucina_slots_busy", "Slots running a job."),
    ("slots", "fucina_slots", "Slots (--parallel)."),
    ("preparing", "fucina_requests_preparing",
     "Requests being parsed and tokenized (a place reserved, no job yet)."),
)


class Histogram:
    """Counts per bucket (`le`: upper bounds, inclusive) and a sum; the caller
    holds the lock."""

    def __init__(self, bounds):
        self.bounds = tuple(float(b) for b in bounds)
        self.counts = [0] * (len(self.bounds) + 1)    # the last: +Inf only
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value

    def copy(self) -> "Histogram":
        other = Histogram(())
        other.bounds, other.counts, other.sum = self.bounds, list(self.counts), self.sum
        return other


class Metrics:
    """The server's own counters, and `render()`: them and the scheduler's."""

    def __init__(self, scheduler):
        self.scheduler = scheduler
        self._lock = threading.Lock()
        self._requests: dict[tuple[str, int], int] = {}
        self._prompt = self._generated = 0
        self._ttft = Histogram(TTFT_BUCKETS)
        self._per_token = Histogram(TOKEN_BUCKETS)

    def answered(self, route: str, status: int) -> None:
        """(The event loop.)  One answer sent."""
        with self._lock:
            key = (route, status)
            self._requests[key] = self._requests.get(key, 0) + 1

    def watch(self, sink, arrival: float, prompt: bool = True):
        """`sink` (a job's: the engine thread calls it), observed on the way.
        `prompt`: count its prompt (False for the 2nd..nth choices of one request,
        whose prompt is the first's).

        Time to first token: `time.perf_counter()` seconds from `arrival` (the
        request's arrival: `App._serve` starts, before its body is read; so the
        body's upload, the wait for a place, preparing, queueing and prefill are
        all in it) to the engine thread handing over the job's first piece of
        answer text, or its reply if the answer ends before any text shows (an
        immediate end marker).  The same for streamed and non-streamed requests:
        it is when the first token existed, not when the client got its first
        byte (a non-streamed client waits for the whole answer).  Text held back
        while it may begin a stop string counts when released; a job that fails
        or is cancelled before its first text is not observed.

        Time per output token: the reply's `decode_seconds / len(ids)`, the
        seconds from the end of its prefill to the end of its answer per token of
        the answer (1 / `Reply.decode_tokens_per_second`; the steps it shared
        with other jobs and their prefill chunks included, as its client sees
        them); not observed for a reply without ids."""
        first = [True]

        def watched(kind: str, payload) -> None:
            try:
                if kind == "done" or (kind == "text" and first[0]):
                    self._observe(kind, payload, arrival, first, prompt)
            except Exception:
                log.exception("the metrics failed to observe a job's event")
            sink(kind, payload)

        return watched

    def _observe(self, kind: str, payload, arrival: float, first: list,
                 prompt: bool) -> None:
        now = time.perf_counter()
        with self._lock:
            if first[0]:
                first[0] = False
                self._ttft.observe(max(0.0, now - arrival))
            if kind == "done":
                reply = payload
                if prompt:
                    self._prompt += reply.prefilled + reply.reused   # the whole prompt
                self._generated += sampled(reply)
                if reply.ids:
                    self._per_token.observe(reply.decode_seconds / len(reply.ids))

    def render(self) -> str:
        """The exposition text (the event loop: nothing here waits long)."""
        state = self.scheduler.snapshot()        # the scheduler's lock, briefly
        alive = self.scheduler.alive
        with self._lock:
            requests = sorted(self._requests.items())
            prompt, generated = self._prompt, self._generated
            ttft, per_token = self._ttft.copy(), self._per_token.copy()
        out: list[str] = []
        _family(out, "fucina_requests_total", "counter",
                "HTTP answers sent, by route template and status code.",
                [({"route": r, "status": str(s)}, n) for (r, s), n in requests])
        _family(out, "fucina_prompt_tokens_total", "counter",
                "Prompt tokens of the jobs that finished with a reply (usage).",
                [({}, prompt)])
        _family(out, "fucina_generated_tokens_total", "counter",
                "Tokens sampled for the jobs that finished with a reply (usage).",
                [({}, generated)])
        for key, name, text in ENGINE_COUNTERS:
            _family(out, name, "counter", text, [({}, state[key])])
        for key, name, text in ENGINE_GAUGES:
            _family(out, name, "gauge", text, [({}, state[key])])
        _family(out, "fucina_engine_up", "gauge",
                "1 while the engine thread runs, 0 once it has stopped.",
                [({}, int(alive))])
        _histogram(out, "fucina_time_to_first_token_seconds",
                   "Seconds from a request's arrival to its first answer text.", ttft)
        _histogram(out, "fucina_time_per_output_token_seconds",
                   "Decode seconds per token of each reply.", per_token)
        return "\n".join(out) + "\n"


class Counted:
    """Pure ASGI, outermost: every answer sent is counted once, by route template
    and status (its `http.response.start`; an exception before any answer is the
    500 uvicorn sends).  `routes`: the application's (`app.router.routes`), to
    name the route whatever answered (a route, the Guard, an error handler).
    `by_path`: paths served by another application (the same routes behind a
    Guard without the API key: /metrics, which a scraper reads without one)."""

    def __init__(self, metrics: Metrics, routes, app, by_path: dict | None = None):
        self.metrics, self.routes, self.app = metrics, list(routes), app
        self.by_path = dict(by_path or {})

    def route_of(self, scope) -> str:
        for route in self.routes:
            match, _ = route.matches(scope)
            if match is not Match.NONE:
                return route.path
        return "unmatched"

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        route = self.route_of(scope)
        app = self.by_path.get(scope.get("path"), self.app)
        sent = False

        async def counted(message):
            nonlocal sent
            if not sent and message["type"] == "http.response.start":
                sent = True
                self.metrics.answered(route, message["status"])
            await send(message)

        try:
            await app(scope, receive, counted)
        except Exception:
            if not sent:
                self.metrics.answered(route, 500)
            raise


# --- the text format -------------------------------------------------------------------

def _family(out: list, name: str, kind: str, text: str, samples) -> None:
    out.append(f"# HELP {name} {_help(text)}")
    out.append(f"# TYPE {name} {kind}")
    for labels, value in samples:
        out.append(f"{name}{_labels(labels)} {_number(value)}")


def _histogram(out: list, name: str, text: str, h: Histogram) -> None:
    out.append(f"# HELP {name} {_help(text)}")
    out.append(f"# TYPE {name} histogram")
    total = 0
    for bound, n in zip(h.bounds + (math.inf,), h.counts):
        total += n
        out.append(f"{name}_bucket{_labels({'le': _number(bound)})} {total}")
    out.append(f"{name}_sum {_number(h.sum)}")
    out.append(f"{name}_count {total}")


def _number(value) -> str:
    if isinstance(value, int):
        return str(value)
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return "NaN" if math.isnan(value) else repr(float(value))


def _help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _labels(labels: dict) -> str:
    if not labels:
        return ""
    inner = ",".join(f'{k}="{_label_value(v)}"' for k, v in labels.items())
    return "{" + inner + "}"


def _label_value(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
