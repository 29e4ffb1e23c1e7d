"""Continuous batching: many requests, one model, one engine thread.

The server (fucina_course/server/) turns each HTTP request into a `Job` (prompt
ids, a sampler, limits, and a `sink` that receives its text) and hands it to a
`Scheduler`.  One engine thread owns the model and `parallel` slots; each slot is
a `chat.Conversation` (a `generation.Sequence`: a KV cache and the ids in it), and
each job a `chat.Turn` over it (`Turn.for_ids`), so a job decodes, stops and
streams exactly as a chat answer does, and the ids a slot lists are exactly the
ids in its cache.  The loop:

    admit     a waiting job takes a free slot and is prefilled there (only the ids
              the slot's cache does not already hold: see "Prefix reuse"), one
              chunk of `prefill_chunk` ids per loop, between decode steps
    choose    every running job samples its next token from its latest logits
              (its own sampler and seed, stop ids, stop strings, max_tokens)
    step      one `generation.advance` for all jobs still running: one
              `forward_step_batch` reads the weights once for all of them
    leave     a job that ended (or was cancelled) gives back its slot at once

So a request joins the batch at the step after its prefill and leaves at the step
it ends; the others do not wait for it.  Rejected alternative: static batches
(collect N requests, run them to the end together), which make a short answer wait
for the longest one and a new request wait for the whole batch.

Speculation (`speculator`, `fucina serve --speculate`): while one job decodes
alone, its step is a verify step (`Decoder.speculate`: its chosen token and the
drafter's guesses, every agreed guess committed); with two or more the plain
batched step runs, since the batch already shares each read of the weights.  A
deterministic drafter leaves every job's tokens as they are (speculative.py), so
the rule "same tokens as alone" still holds.

Same tokens as alone.  Each job keeps its own `Sampler` (its own seeded stream, one
draw per token) and its own cache, and a batched decode row is computed like a
single decode step, so a greedy job's tokens equal the same job served alone
(tests/test_server.py serves 4 concurrent streams and the same prompts one at a
time and compares the texts).  A prefill runs alone (one job, its own rows), never
mixed into a decode step, and row by row (`_ExactPrefill`), so neither the batch
nor what a slot had cached changes the numbers a request's tokens come from.

Prefix reuse, across clients.  A slot keeps the ids its last job left in its cache
(prompt and answer).  A new job takes the free slot whose cache shares the longest
prefix with its prompt (ties: the slot used least recently) and prefills only the
rest: the same system prompt, or the conversation so far of a client that sends its
history again, is not recomputed.  Reuse is across clients, not per client: the
server has no notion of a client (no session id in the OpenAI API), and a shared
system prompt is the common case.  Its cost is a timing side channel (a client
can tell that a prefix was recently seen); a server shared by mutually distrustful
users should run with one slot per user or without reuse.  Measured in
tests/test_server.py: the second request with the same system prompt prefills
only the tokens after it (`usage.prompt_tokens_details.cached_tokens`).

Choices (n > 1).  The n jobs of one request share a `group`; one prefills the
prompt, the others wait, copy its rows (`Sequence.copy_from`: an array copy per
layer) and run its last id only: n = 2 prefills len(prompt) + 1 ids, not twice.

Load.  At most `parallel` jobs run and `queue_size` wait (default 2 x parallel);
`submit` refuses more with `Busy` (the server's 429 with Retry-After), so memory and
latency stay bounded whatever the clients do.  A request takes its place in that
load *before* it is parsed, rendered and tokenized (`reserve`, then `submit(job,
reservation)`), so at most parallel + queue_size requests are being prepared or
run at any time: many hostile prompts cannot all tokenize at once.  `cancel`
removes a waiting job, or marks a running one, which gives back its slot at the
next step boundary (one decode step at most).  `shutdown` cancels every job and
ends the thread.

Failures.  Everything done for one job (its prefill, sampling, the end of its
turn) runs inside that job's own `try`: a failure ends that job with an error
(the client gets it), and its slot is given back with a consistent conversation
(reset to empty if the failure left its state unknown), while the other jobs go
on.  An exception outside that (a bug in the loop itself) ends the engine thread:
every job gets an error, `failure` records why, and the server stops the process
(server/process.py) rather than answer 503 forever.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections import deque
from dataclasses import dataclass
from typing import Callable, Sequence

from .chat import Conversation, Reply, Turn
from .generation import Piece, advance
from .kv_cache import common_prefix, prompt_fits
from .errors import ContextFull, FucinaError
from .sampler import Sampler, SamplerConfig

log = logging.getLogger("fucina.serve")


class Busy(FucinaError):
    """Every slot is running and the queue is full: try again later."""


class ShuttingDown(FucinaError):
    """The scheduler is stopping: no new jobs."""


class EngineFailed(FucinaError):
    """The engine thread died of an error in its loop (a bug): no more jobs."""


class Reservation:
    """A place in the scheduler's load, taken before a request is prepared.

    `Scheduler.submit(job, reservation)` hands the place to the job; until then
    `release()` gives it back (idempotent, and a no-op once a job took it), so a
    request that fails while it is parsed, rendered or tokenized frees its place
    on every path (`with scheduler.reserve() as r:` releases on the way out)."""

    def __init__(self, scheduler: "Scheduler"):
        self._scheduler = scheduler
        self.held = True

    def release(self) -> None:
        self._scheduler._unreserve(self)

    def __enter__(self) -> "Reservation":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


@dataclass(eq=False)
class Job:
    """One request: what to run, and where its results go.

    `ids`: the whole prompt (a slot may already hold a prefix of it); `text`: what
    it spells (kept with the slot's ids).  `sink(kind, payload)` is called from the
    engine thread: ("text", str) for each piece of visible text (stop strings held
    back until they are known not to be one), then exactly once either
    ("done", Reply) or ("error", FucinaError).  `max_tokens`: None runs until an
    end-of-turn id, a stop string or a full cache.  `logprobs` (k): each token's
    logprob and k alternatives, in the text pieces (`generation.Piece`) and the
    reply.  `group`: an object the jobs of one request share ("Choices")."""

    ids: Sequence[int]
    text: str
    sampler: Sampler
    sink: Callable[[str, object], None]
    max_tokens: int | None = None
    stop: Sequence[str] = ()
    logprobs: int | None = None
    group: object = None
    cancelled: bool = False
    reason: str | None = None        # why it was cancelled ("client", "shutdown")
    over: bool = False               # the sink got "done" or "error"

    def _emit(self, kind: str, payload) -> None:
        if self.over:
            return
        if kind in ("done", "error"):
            self.over = True
        try:
            self.sink(kind, payload)
        except Exception:            # a sink must never take the engine down
            log.exception("a job's sink failed")


class _ExactPrefill:
    """The model, as a slot's conversation sees it: a prompt of several tokens is
    prefilled with `per_row=True`, every row computed exactly as a decode step.

    Why: the fast prefill's last bits depend on how the prompt is split (which
    rows are in the step, which are already cached): measured on the default model,
    the logits after a 36-token chat prompt prefilled whole, or as 35 cached + 1 or
    34 + 2 new, differ by up to 0.31, and a completion's greedy continuation
    flipped (" Paris. Paris is" whole, " Paris. The capital" after a prefix hit).
    Per row, the result is the same for every split (checked bit for bit for
    splits 1..9 of 20-, 40- and 70-token prompts), so prefix reuse and batching
    never change a request's tokens: they are a function of its prompt and
    sampler alone.  Cost: where "auto" runs the multi-row tiles too, none
    measurable; at avx512vnni, whose prompts of 16+ tokens "auto" gives to the
    packed GEMM (quant/_int_packed.py), a per-row prefill takes about two to
    three times as long (measured: docs/BENCHMARKS.md#exact-prefill).  The time
    to a first token stays low where it matters most, on a shared system prompt, which a slot's
    prefix cache skips.  Rejected alternative: keep the fast prefill and only reuse
    prefixes that leave a long enough suffix; no suffix length made the last row
    exact for every prompt length (the kernels tile rows, and fewer than 16 rows
    never take the packed GEMM)."""

    def __init__(self, model):
        self._model = model

    def __getattr__(self, name):
        return getattr(self._model, name)

    def forward_step(self, ids, pos0, cache, *, per_row: bool = False):
        return self._model.forward_step(ids, pos0, cache,
                                        per_row=per_row or len(ids) > 1)


@dataclass(eq=False)
class _Slot:
    conv: Conversation
    index: int
    job: Job | None = None
    turn: Turn | None = None
    logits: object = None
    next: int | None = None          # a token speculation already chose
    last_used: int = 0


@dataclass
class Stats:
    """What the engine did since it started (for /health and the tests)."""

    jobs: int = 0                    # jobs that got a slot
    prefilled: int = 0               # prompt ids run through the model
    reused: int = 0                  # prompt ids found in a slot's cache
    steps: int = 0                   # decode steps
    rows: int = 0                    # decode rows (tokens) over all steps
    max_rows: int = 0                # the widest step
    rejected: int = 0                # Busy
    cancelled: int = 0
    drafted: int = 0                 # speculation: guesses checked
    accepted: int = 0                # and agreed with


class Scheduler:
    """`parallel` slots of `capacity` positions each over one model (see the module
    docstring).  `start()` the engine thread, `submit(job)`, `cancel(job)`,
    `shutdown()`.  `exact_prefill` (default): prefill row by row, so that a
    request's tokens do not depend on what the slot had cached (`_ExactPrefill`)."""

    def __init__(self, model, *, parallel: int = 4, capacity: int | None = None,
                 cache_type: str = "f16", queue_size: int | None = None,
                 exact_prefill: bool = True, prefill_chunk: int = 64,
                 speculator=None):
        if model.tokenizer is None:
            raise FucinaError(f"{model.path}: no tokenizer in the file: it cannot serve")
        if parallel < 1:
            raise FucinaError(f"parallel must be at least 1, got {parallel}")
        queue_size = 2 * parallel if queue_size is None else queue_size
        if queue_size < 0:
            raise FucinaError(f"the queue size must be at least 0, got {queue_size}")
        if prefill_chunk < 1:
            raise FucinaError(f"prefill_chunk must be at least 1, got {prefill_chunk}")
        self.model = model
        self.speculator = speculator
        self.parallel, self.queue_size = parallel, queue_size
        # chunked prefill is exact only row by row; the fast path prefills whole
        self.prefill_chunk = prefill_chunk if exact_prefill else 1 << 30
        greedy = Sampler(SamplerConfig.greedy())          # replaced by each job's
        exact = _ExactPrefill(model) if exact_prefill else model
        self.slots = [_Slot(Conversation(exact, sampler=greedy, capacity=capacity,
                                         cache_type=cache_type, show_think=True), i)
                      for i in range(parallel)]
        self.capacity = self.slots[0].conv.cache.capacity
        self.format = self.slots[0].conv.format
        self.stats = Stats()
        self._waiting: deque[Job] = deque()
        self._load = 0                   # places reserved or jobs not yet over
        self._cv = threading.Condition()
        self._stopping = False
        self.failure: BaseException | None = None   # what killed the engine thread
        self._clock = itertools.count(1)
        self._thread = threading.Thread(target=self._run, name="fucina-engine",
                                        daemon=True)

    # --- the other threads' side ---------------------------------------------------

    def start(self) -> "Scheduler":
        self._thread.start()
        return self

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def reserve(self) -> Reservation:
        """A place for one request (see "Load"): `Busy` if parallel + queue_size
        places are taken (running, waiting or being prepared), `ShuttingDown` once
        the scheduler stops."""
        with self._cv:
            self._check_open()
            if self._load >= self.parallel + self.queue_size:
                self.stats.rejected += 1
                busy = sum(s.job is not None for s in self.slots)
                raise Busy(f"all {self.parallel} slots are busy and "
                           f"{self._load - busy} more requests are waiting or being "
                           "prepared")
            self._load += 1
            return Reservation(self)

    def _unreserve(self, reservation: Reservation) -> None:
        with self._cv:
            if reservation.held:
                reservation.held = False
                self._load -= 1
                self._cv.notify()

    def _check_open(self) -> None:
        """(Under the lock.)"""
        if self.failure is not None:
            raise EngineFailed(f"the engine has stopped: {_one_line(self.failure)}")
        if self._stopping:
            raise ShuttingDown("the server is shutting down")

    def submit(self, job: Job, reservation: Reservation | None = None) -> None:
        """Queue `job` in the place `reservation` holds (which it takes over), or in
        a new one: `Busy` if parallel + queue_size places are taken.  On an error
        the reservation stays with the caller, who releases it."""
        if not prompt_fits(len(job.ids), self.capacity):
            raise ContextFull(f"the prompt has {len(job.ids)} tokens (+1 to answer) "
                              f"but the context holds {self.capacity} positions")
        own = reservation is None
        if own:
            reservation = self.reserve()
        with self._cv:
            try:
                if not reservation.held:
                    raise FucinaError("this reservation was released or used")
                self._check_open()
            except FucinaError:
                if own:
                    reservation.held = False
                    self._load -= 1
                raise
            reservation.held = False     # the job holds the place now
            self._waiting.append(job)
            self._cv.notify()

    def cancel(self, job: Job, reason: str = "client") -> None:
        """Stop `job` (idempotent; nothing happens to a job that is over): a waiting
        job leaves the queue now, a running one gives back its slot at the next step
        boundary."""
        with self._cv:
            if job.over or job.cancelled:
                return
            job.cancelled, job.reason = True, reason
            self.stats.cancelled += 1
            if job in self._waiting:
                self._waiting.remove(job)
                self._load -= 1
                job._emit("error", FucinaError(f"cancelled ({reason})"))
            self._cv.notify()

    def shutdown(self) -> None:
        """Cancel every job (each gets its "error") and end the engine thread."""
        with self._cv:
            self._stopping = True
            self._cv.notify()

    def join(self, timeout: float | None = None) -> None:
        if self._thread.is_alive():
            self._thread.join(timeout)

    def snapshot(self) -> dict:
        """Slots busy and idle, jobs waiting, requests being prepared (their place
        reserved, not yet submitted), and the counters (a copy)."""
        with self._cv:
            busy = sum(s.job is not None for s in self.slots)
            waiting = len(self._waiting)
            return dict(slots=self.parallel, busy=busy, idle=self.parallel - busy,
                        waiting=waiting, preparing=self._load - busy - waiting,
                        capacity=self.capacity, **vars(self.stats))

    # --- the engine thread ---------------------------------------------------------

    def _run(self) -> None:
        error = None
        try:
            while True:
                with self._cv:
                    while (not self._stopping and not self._waiting
                           and not any(s.job for s in self.slots)):
                        self._cv.wait()
                    if self._stopping:
                        break
                    self._admit()
                for slot in self.slots:
                    if slot.job is not None and (slot.turn is None
                                                 or not slot.turn.started):
                        self._prefill(slot)
                self._step()
        except BaseException as e:       # a bug in the loop: say so, fail every job
            self.failure = e
            log.error("the engine thread failed; the server stops", exc_info=True)
            error = EngineFailed(f"the engine failed: {_one_line(e)}")
        finally:
            try:
                self._stop_all(error)
            except BaseException as e:   # pragma: no cover - a bug in the cleanup
                self.failure = self.failure or e
                log.error("stopping the jobs failed", exc_info=True)

    def _admit(self) -> None:
        """(Under the lock.)  Waiting jobs into free slots, each into the free slot
        whose cache shares the longest prefix with its prompt."""
        while self._waiting:
            free = [s for s in self.slots if s.job is None]
            if not free:
                break
            job = self._waiting.popleft()
            slot = max(free, key=lambda s: (common_prefix(s.conv.tokens, job.ids),
                                            -s.last_used))
            slot.job = job

    def _prefill(self, slot: _Slot) -> None:
        """The next chunk of a new job's prompt (the first one also opens its turn).

        Chunks of `prefill_chunk` ids, one per loop: the running jobs decode a step
        between two chunks, so a long prompt delays their next token by one chunk's
        time, not by its whole prefill.  Rows are computed one by one
        (`_ExactPrefill`), so the chunking does not change a single bit."""
        job, conv = slot.job, slot.conv
        try:
            if job.cancelled:
                slot.turn = None
                self._release(slot, error=FucinaError(f"cancelled ({job.reason})"))
                return
            if slot.turn is None:
                if self._share_prompt(slot):
                    return                   # a sibling is prefilling it: wait
                conv.sampler, conv.stop = job.sampler, tuple(job.stop)
                conv.max_response_tokens = job.max_tokens

                def write(text: str, _job=job, _slot=slot) -> None:
                    _job._emit("text", Piece(text, _slot.turn.decoder.new_logprobs()))

                slot.turn = Turn.for_ids(conv, job.ids, job.text, write, job.logprobs)
                self.stats.jobs += 1
                self.stats.prefilled += len(slot.turn.new)
                self.stats.reused += slot.turn.keep
            slot.logits = slot.turn.prefill(self.prefill_chunk)
        except FucinaError as e:         # the job's own (a prompt that does not fit)
            slot.turn = None             # the ids cached so far are a valid prefix
            self._release(slot, error=e)
        except Exception as e:
            self._abort(slot, _internal(e, "prefill"))

    def _share_prompt(self, slot: _Slot) -> bool:
        """n > 1: True while a sibling prefills, else copy the prompt it holds."""
        ids, group = slot.job.ids, slot.job.group
        sibs = [s for s in self.slots if s is not slot and s.turn is not None
                and group is not None and s.job.group is group]
        if any(not s.turn.started for s in sibs):
            return True
        best = max(sibs, key=lambda s: common_prefix(s.conv.tokens, ids), default=None)
        n = min(common_prefix(best.conv.tokens, ids) if best else 0, len(ids) - 1)
        if n > common_prefix(slot.conv.tokens, ids):
            slot.conv.seq.copy_from(best.conv.seq, n)
        return False

    def _step(self) -> None:
        """Sample for every running job; one forward step for those that go on.

        One turn of `generation.decode`'s lockstep loop, with the same `choose` and
        `advance`; the loop itself is the engine thread's, since between two steps
        it admits jobs and prefills chunks, and a failure ends one job, not all."""
        picks: list[tuple[_Slot, int]] = []
        for slot in self.slots:
            if slot.turn is None or not slot.turn.started:
                continue
            try:
                tid = self._choose(slot)
            except Exception as e:
                self._abort(slot, _internal(e, "sampling"))
                continue
            if tid is not None:
                picks.append((slot, tid))
        if not picks:
            return
        if len(picks) == 1 and self.speculator is not None:
            self._speculate(*picks[0])
            return
        try:
            out = advance([(s.turn.decoder, tid) for s, tid in picks])
        except Exception as e:
            error = _internal(e, "a decode step")
            for slot, _ in picks:
                self._abort(slot, error)
            return
        self.stats.steps += 1
        self.stats.rows += len(picks)
        self.stats.max_rows = max(self.stats.max_rows, len(picks))
        for (slot, _), logits in zip(picks, out):
            slot.logits = logits

    def _choose(self, slot: _Slot) -> int | None:
        """The job's next token, or None once its answer is over (then closed)."""
        if slot.job.cancelled:
            self._finish(slot, "interrupted")
            return None
        try:
            tid, slot.next = (slot.next if slot.next is not None
                              else slot.turn.decoder.choose(slot.logits)), None
        except FucinaError as e:         # the job's own: a grammar that cannot go on
            self._finish(slot, "error", error=e)
            return None
        if tid is None:
            self._finish(slot)
        return tid

    def _speculate(self, slot: _Slot, tid: int) -> None:
        """A job decoding alone: one verify step of `tid` and the drafter's
        guesses; the token it chose next waits in `slot.next`."""
        turn = slot.turn.decoder
        drafted, accepted = turn.drafted, turn.accepted
        try:
            try:
                slot.next = turn.speculate(tid, self.speculator)
            except FucinaError as e:
                self._finish(slot, "error", error=e)
                return
            self.stats.steps += 1
            self.stats.rows += 1 + turn.drafted - drafted
            self.stats.max_rows = max(self.stats.max_rows, 1 + turn.drafted - drafted)
            self.stats.drafted += turn.drafted - drafted
            self.stats.accepted += turn.accepted - accepted
            if slot.next is None:
                self._finish(slot)
        except Exception as e:
            self._abort(slot, _internal(e, "a speculative step"))

    def _finish(self, slot: _Slot, reason: str | None = None,
                error: FucinaError | None = None) -> None:
        """The slot's answer is over: close its turn (the cache keeps its ids for
        the next job), report, give the slot back.  Called inside the job's `try`
        (`_choose`, `_speculate`); if closing the turn fails, `_abort` ends the
        job instead."""
        try:
            reply = slot.turn.finish(reason)
        except Exception as e:
            self._abort(slot, _internal(e, "closing the answer"))
            return
        slot.turn, slot.logits = None, None
        if error is None and reply.stop_reason == "interrupted":
            error = (ShuttingDown("the server is shutting down")
                     if slot.job.reason == "shutdown"
                     else FucinaError(f"cancelled ({slot.job.reason})"))
        self._release(slot, reply=reply, error=error)

    def _abort(self, slot: _Slot, error: FucinaError) -> None:
        """A job failed in a way that is not its own doing (a bug, bad logits, a
        turn that could not be closed): the client gets `error`, and the slot's
        conversation is reset, since the state the failure left it in is unknown
        (its prefix cache is lost; the other slots are untouched).  An exception
        here is outside every job's `try`: it ends the engine thread."""
        if slot.job is None:             # released before it failed
            return
        slot.turn = None
        slot.conv.reset()
        self._release(slot, error=error)

    def _release(self, slot: _Slot, reply: Reply | None = None,
                 error: FucinaError | None = None) -> None:
        job = slot.job
        with self._cv:
            slot.job, slot.turn, slot.logits, slot.next = None, None, None, None
            slot.last_used = next(self._clock)
            self._load -= 1
        if error is not None:
            job._emit("error", error)
        else:
            job._emit("done", reply)

    def _stop_all(self, error: FucinaError | None = None) -> None:
        """Shutdown (or a failed engine, `error`): every running and waiting job
        ends, with `error` or `ShuttingDown`."""
        with self._cv:
            self._stopping = True
        for slot in self.slots:
            if slot.job is None:
                continue
            slot.job.cancelled, slot.job.reason = True, "shutdown"
            if error is None and slot.turn is not None and slot.turn.started:
                try:
                    self._finish(slot, "interrupted")
                    continue
                except Exception:
                    log.exception("closing a turn failed")
            if slot.job is not None:
                slot.turn = None
                if error is not None:
                    slot.conv.reset()
                self._release(slot, error=error or ShuttingDown(
                    "the server is shutting down"))
        with self._cv:
            waiting, self._waiting = list(self._waiting), deque()
            self._load -= len(waiting)
        for job in waiting:
            job._emit("error", error or ShuttingDown("the server is shutting down"))


def _internal(exc: Exception, where: str) -> FucinaError:
    """An unexpected exception met while serving one job: logged with its
    traceback (it is a bug), and the one-line error its client gets."""
    log.error("a job failed in %s", where, exc_info=exc)
    return FucinaError(f"internal error in {where}: {_one_line(exc)}")


def _one_line(exc: BaseException) -> str:
    """`Type: message` on one line (a message may hold newlines)."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
