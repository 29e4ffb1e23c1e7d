"""`fucina serve` under hostile input, on every path into it: huge, degenerate (one
character repeated), malformed and interrupted requests, and failures inside the
engine.

The promises (issue #42):
* the event loop never does work that grows with a body: while one request's
  prompt is parsed and encoded, /health answers within a second and other
  requests go on;
* a prompt that cannot fit is refused before it is encoded when its byte count
  alone proves it (`App._check_bound`), and every request holds a place in the
  scheduler's load while it is prepared, released on every way out;
* a failure serving one job ends that job with an error, never the engine; a
  failure of the engine's own loop ends `Server.run` (and the command: one line,
  status 1) within seconds, instead of a process that answers 503 forever.

Servers run in this process over the module's one model (tests/test_server.py
explains the fixtures); one test starts the command in a subprocess.  Time limits
are generous margins over what was measured on 2 cores (in comments).
"""

from __future__ import annotations

import json
import math
import re
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

openai = pytest.importorskip("openai")

from fucina_course.errors import FucinaError                     # noqa: E402
from fucina_course.server import Server                          # noqa: E402

MODEL = "qwen2.5-coder-0.5b"
CTX = 384
ONE_WORD = "a" * 200_000             # the prompt: one 200 KB "word"


@pytest.fixture(scope="module")
def model(coder_model):
    return coder_model


@pytest.fixture(scope="module")
def small(model):
    """A short context and the default 4 MiB body limit."""
    with Server(model, model_id=MODEL, port=0, parallel=2, ctx=CTX) as s:
        yield s


@pytest.fixture(scope="module")
def big(model):
    """A context long enough that the byte bound lets ONE_WORD through: it is
    encoded (25,000 tokens) and refused only then."""
    with Server(model, model_id=MODEL, port=0, parallel=2, ctx=4096) as s:
        yield s


@pytest.fixture
def tight(model):
    """One slot and one place in the queue: two places in all."""
    with Server(model, model_id=MODEL, port=0, parallel=1, ctx=CTX,
                queue_size=1) as s:
        yield s


def client_of(server) -> "openai.OpenAI":
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0,
                         timeout=120)


def chat_body(content, **kw) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}],
            "max_tokens": 8, "temperature": 0, **kw}


def post(server, path, body, timeout=60, **kw):
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(server.url + path, content=data, timeout=timeout,
                      headers={"Content-Type": "application/json"}, **kw)


def error_of(r, status, param=None) -> dict:
    assert r.status_code == status, r.text[:300]
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


def load(server) -> dict:
    snap = server.scheduler.snapshot()
    return {k: snap[k] for k in ("busy", "waiting", "preparing")}


def wait_idle(server, timeout=10.0) -> None:
    deadline = time.monotonic() + timeout
    while any(load(server).values()):
        assert time.monotonic() < deadline, f"still busy: {load(server)}"
        time.sleep(0.05)


def address(server) -> tuple[str, int]:
    return server.host, server.port


def timed(f, *args, **kw):
    t0 = time.monotonic()
    out = f(*args, **kw)
    return out, time.monotonic() - t0


class Encoder:
    """The server's tokenizer, with a hook run before each encoding (to make it
    slow, or wait, on the prompts a test picks); everything else is the real
    tokenizer's."""

    def __init__(self, tokenizer, hook):
        self._tok, self._hook = tokenizer, hook
        self.calls = 0

    def __getattr__(self, name):
        return getattr(self._tok, name)

    def encode(self, text, **kw):
        self.calls += 1
        self._hook(text)
        return self._tok.encode(text, **kw)

    def encode_raw(self, text, **kw):
        self.calls += 1
        self._hook(text)
        return self._tok.encode_raw(text, **kw)


def in_background(f, *args, **kw) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def run():
        t0 = time.monotonic()
        try:
            out["result"] = f(*args, **kw)
        except BaseException as e:       # reported by the test that joins
            out["error"] = e
        out["seconds"] = time.monotonic() - t0

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


# --- huge prompts: the acceptance ---------------------------------------------

def assert_still_answering(server, question: str, max_tokens: int,
                           health_checks: int = 1) -> None:
    """While a big request is in flight: /health within 1 s (each of
    `health_checks` times) and a small chat within 15 s (the issue's bounds)."""
    for _ in range(health_checks):
        health, seconds = timed(httpx.get, server.url + "/health", timeout=10)
        assert health.status_code == 200 and seconds < 1.0, seconds
    reply, seconds = timed(client_of(server).chat.completions.create, model=MODEL,
                           max_tokens=max_tokens, temperature=0,
                           messages=[{"role": "user", "content": question}])
    assert reply.choices[0].message.content and seconds < 15, seconds


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"model": MODEL, "prompt": ONE_WORD, "max_tokens": 4},
     "prompt"),
    ("/v1/chat/completions", chat_body(ONE_WORD), "messages"),
])
def test_a_huge_one_word_prompt_does_not_hold_the_server(big, path, body, param):
    """The issue: 200 KB of one character, sent to a server whose context the byte
    bound cannot rule it out for (ceil(200,000 / 128) = 1,563 < 4,096), so it is
    encoded.  Meanwhile /health answers within 1 s and a two-word chat finishes
    within 15 s; the big prompt gets its 400 within 30 s.  Measured with the
    O(n log n) BPE (2 cores of an AMD EPYC, 2026-12): the 400 after 0.4-0.5 s,
    /health in 0.08 s, the chat in 0.15-0.6 s (alone: 0.6 s).  Before: the 400
    after 362 s, /health timed out, the chat waited 243 s."""
    least = math.ceil(len(ONE_WORD) / big.app.longest_token)
    assert least + 1 <= big.scheduler.capacity      # the bound lets it through
    thread, out = in_background(post, big, path, body, timeout=120)
    time.sleep(0.3)                                  # it is read and being prepared
    assert_still_answering(big, "Hello there", 8)
    thread.join(120)
    assert "error" not in out, out
    err = error_of(out["result"], 400, param)
    assert err["code"] == "context_length_exceeded"
    assert int(re.search(r"has (\d+) tokens", err["message"])[1]) >= 25_000
    assert out["seconds"] < 30, out["seconds"]
    wait_idle(big)


def test_a_slow_encoding_runs_off_the_event_loop(big, monkeypatch):
    """Whatever the encoder costs, it runs off the event loop: one made to spin
    for 6 s of Python bytecode on the big prompt, and /health still answers at
    once and a chat goes through while it spins (measured: /health 0.07-0.1 s,
    the chat 2.7 s against 0.6 s alone: the threads share the GIL).  Not a claim
    about every encoder: the old quadratic BPE, whose single list operations over
    200,000 parts hold the GIL for tens of milliseconds each, slowed such a chat
    to 52 s (GIL convoy) though /health stayed at 0.1 s; the O(n log n) BPE and
    its chunk cap bound that to ~0.5 s per request."""
    spinning = threading.Event()

    def spin(text):
        if len(text) > 100_000:
            spinning.set()
            end = time.monotonic() + 6.0
            while time.monotonic() < end:
                sum(range(1000))

    monkeypatch.setattr(big.app, "tokenizer", Encoder(big.app.tokenizer, spin))
    thread, out = in_background(post, big, "/v1/completions",
                                {"model": MODEL, "prompt": ONE_WORD}, timeout=120)
    assert spinning.wait(10)
    assert load(big)["preparing"] == 1
    assert_still_answering(big, "Hi", 4, health_checks=3)
    assert thread.is_alive()                         # the big one still spins
    thread.join(60)
    assert error_of(out["result"], 400, "prompt")["code"] == "context_length_exceeded"
    wait_idle(big)


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"model": MODEL, "prompt": "a" * 300_000}),
    ("/v1/chat/completions", chat_body("a" * 300_000)),
    ("/v1/chat/completions", chat_body("x" + " " * 300_000 + "y")),
])
def test_what_the_tokenizer_refuses_is_a_400(big, path, body):
    """A run of one character class over the tokenizer's chunk limit (256 KiB,
    bpe.MAX_CHUNK_BYTES) passes the byte bound at this context but is
    refused by the encoder: a 400 naming the prompt, not a 500."""
    r, seconds = timed(post, big, path, body)
    err = error_of(r, 400, "prompt" if path == "/v1/completions" else "messages")
    assert "cannot be encoded" in err["message"] and seconds < 10, seconds
    wait_idle(big)


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"model": MODEL, "prompt": "a" * 60_000}, "prompt"),
    ("/v1/chat/completions", chat_body("a" * 60_000), "messages"),
    ("/v1/responses", {"model": MODEL, "input": "a" * 60_000}, "input"),
    ("/v1/completions", {"model": MODEL, "prompt": "a" * ((4 << 20) - 100)}, "prompt"),
])
def test_the_byte_bound_refuses_before_encoding(small, monkeypatch, path, body, param):
    """60,000 bytes are at least ceil(60,000 / 128) = 469 tokens: more than the
    384 positions, known without encoding a thing."""
    encoder = Encoder(small.app.tokenizer, lambda text: None)
    monkeypatch.setattr(small.app, "tokenizer", encoder)
    r, seconds = timed(post, small, path, body)
    err = error_of(r, 400, param)
    assert err["code"] == "context_length_exceeded" and "at least" in err["message"]
    assert encoder.calls == 0 and seconds < 5, seconds
    wait_idle(small)


# --- the load: places reserved before the work, released on every way out -------------

def test_places_are_reserved_before_encoding(tight, monkeypatch):
    """Two places (1 slot + 1 in the queue): two requests held inside their
    encoding take both, and a third is refused at once with 429, not encoded."""
    gate = threading.Event()
    encoder = Encoder(tight.app.tokenizer,
                      lambda text: "GATE" in text and gate.wait(30))
    monkeypatch.setattr(tight.app, "tokenizer", encoder)
    held = [in_background(post, tight, "/v1/chat/completions",
                          chat_body(f"GATE {i}: say hi", max_tokens=2))
            for i in range(2)]
    deadline = time.monotonic() + 10
    while encoder.calls < 2:                         # both inside their encoding
        assert time.monotonic() < deadline, load(tight)
        time.sleep(0.02)
    assert load(tight)["preparing"] == 2
    calls = encoder.calls
    with pytest.raises(openai.RateLimitError) as info:
        client_of(tight).chat.completions.create(
            model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "hi"}])
    assert info.value.response.headers["retry-after"] == "1"
    assert encoder.calls == calls                    # refused before any work
    assert httpx.get(tight.url + "/health").json()["preparing"] == 2
    gate.set()
    for thread, out in held:
        thread.join(60)
        assert out["result"].status_code == 200, out
    wait_idle(tight)


def test_reservations(model):
    """The scheduler's side: parallel + queue_size places; a released place comes
    back once (release is idempotent), a used one cannot be used again, and a
    stopping scheduler reserves nothing."""
    from fucina_course.sampler import Sampler, SamplerConfig
    from fucina_course.scheduler import Busy, Job, Scheduler, ShuttingDown

    sched = Scheduler(model, parallel=1, capacity=64, queue_size=1)   # not started
    a, b = sched.reserve(), sched.reserve()
    with pytest.raises(Busy):
        sched.reserve()
    assert sched.snapshot()["preparing"] == 2
    a.release()
    a.release()
    c = sched.reserve()
    with pytest.raises(Busy):
        sched.reserve()
    job = Job(ids=[1, 2, 3], text="", sampler=Sampler(SamplerConfig.greedy()),
              sink=lambda kind, payload: None)
    sched.submit(job, b)
    assert sched.snapshot()["waiting"] == 1 and sched.snapshot()["preparing"] == 1
    b.release()                                      # the job holds that place now
    with pytest.raises(FucinaError, match="released or used"):
        sched.submit(job, b)
    with c:                                          # released on the way out
        pass
    assert sched.snapshot()["preparing"] == 0
    sched.shutdown()
    with pytest.raises(ShuttingDown):
        sched.reserve()


def test_every_error_releases_its_place(tight, monkeypatch):
    """Each kind of failure, three times over on a server of two places: a leaked
    place would turn the third into a 429."""
    chat, comp = "/v1/chat/completions", "/v1/completions"
    schema = {"type": "json_schema", "json_schema": {
        "schema": {"type": "string", "pattern": "(?=a)b"}}}
    cases = [
        (chat, b'{"model": ', 400), (chat, b"[1, 2]", 400),
        (chat, chat_body("hi", n=2), 400),
        (chat, {**chat_body("hi"), "model": "x"}, 404),
        (chat, chat_body("hi", max_tokens="5"), 400), (chat, chat_body(5), 400),
        (chat, chat_body("a" * 60_000), 400),                 # the byte bound
        (chat, chat_body("word " * 400), 400),                # too long once encoded
        (comp, {"model": MODEL, "prompt": [1, 2, 151936]}, 400),
        (chat, chat_body("hi", logit_bias={"5": 500}), 400),
        (chat, chat_body("hi", top_p=0), 400),
        (chat, chat_body("hi", response_format=schema), 400),  # a grammar error
        (chat, {"model": MODEL, "messages": []}, 400),
    ]
    for path, body, status in cases:
        for _ in range(3):
            r = post(tight, path, body)
            assert r.status_code == status, (body if len(str(body)) < 200 else path,
                                             r.text[:200])
        assert load(tight) == {"busy": 0, "waiting": 0, "preparing": 0}, body
    # a bug while preparing: a 500, and the place is back too
    def broken(req):
        raise RuntimeError("a bug in preparing")

    monkeypatch.setattr(tight.app, "_prepare_chat", broken)
    for _ in range(3):
        err = error_of(post(tight, chat, chat_body("hi")), 500)
        assert err["type"] == "server_error"
    assert load(tight) == {"busy": 0, "waiting": 0, "preparing": 0}
    monkeypatch.undo()
    assert post(tight, chat, chat_body("hi", max_tokens=2)).status_code == 200


def test_a_client_gone_while_its_request_is_prepared(tight, monkeypatch):
    """The client gives up while its prompt is being encoded: the job is
    submitted when the encoding ends, noticed as abandoned and cancelled, and its
    place comes back."""
    gate = threading.Event()
    monkeypatch.setattr(tight.app, "tokenizer", Encoder(
        tight.app.tokenizer, lambda text: "GATE" in text and gate.wait(30)))
    cancelled = tight.scheduler.snapshot()["cancelled"]
    body = json.dumps(chat_body("GATE: List the numbers from 1 to 200, one per line.",
                                 max_tokens=400)).encode()
    with socket.create_connection(address(tight), timeout=5) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     b"Content-Type: application/json\r\nContent-Length: "
                     + str(len(body)).encode() + b"\r\n\r\n" + body)
        deadline = time.monotonic() + 10
        while load(tight)["preparing"] < 1:            # read, and being encoded
            assert time.monotonic() < deadline, load(tight)
            time.sleep(0.02)
    gate.set()                                         # the client is gone
    wait_idle(tight, timeout=10)
    snap = tight.scheduler.snapshot()
    assert snap["cancelled"] == cancelled + 1 and snap["rows"] < 150, str(snap)


# --- malformed and degenerate bodies --------------------------------------------------

def test_malformed_bodies_are_400s(small):
    chat = "/v1/chat/completions"
    four_mib = 4 << 20
    cases = [
        (b"[" + b"1," * (four_mib // 2 - 2) + b"1]", None),  # a 4 MiB JSON array
        (b"[" * 100_000 + b"]" * 100_000, None),           # nested 100,000 deep
        (b"a" * (four_mib - 1), None),                     # 4 MiB of one character
        (b" " * (four_mib - 10) + b"{}", "model"),         # ... around an empty object
        (b'{"model": "\xff\xfe"}', None),                  # not UTF-8
        (json.dumps(chat_body("hi"))[:-1] + ', "max_tokens": 1e999}', "max_tokens"),
        ('{"model": "m", "max_tokens": ' + "9" * 5000 + "}", None),   # int digits cap
        (json.dumps({**chat_body("hi"), "response_format": _nested(300)}),
         "response_format"),
    ]
    for body, param in cases:
        r, seconds = timed(post, small, chat, body)
        error_of(r, 400, param)
        assert seconds < 10, (seconds, body[:40])
    # the messages themselves: 100,000 of them (3 MB), refused in bounded time
    many = {"model": MODEL, "messages": [{"role": "user", "content": "x"}] * 100_000}
    r, seconds = timed(post, small, chat, many)
    assert error_of(r, 400)["code"] in ("context_length_exceeded", None)
    assert seconds < 20, seconds
    assert httpx.get(small.url + "/health").json()["status"] == "ok"
    wait_idle(small)


def _nested(depth: int) -> dict:
    value: dict = {"type": "json_schema"}
    for _ in range(depth):
        value = {"type": "json_schema", "json_schema": {"schema": value}}
    return value


def test_a_body_over_the_limit_without_a_length(small):
    def chunks():
        for _ in range(5):
            yield b" " * (1 << 20)

    r = httpx.post(small.url + "/v1/chat/completions", content=chunks(), timeout=60)
    assert error_of(r, 413)["code"] == "request_too_large"


def test_token_id_prompts(small, model):
    comp = "/v1/completions"
    for prompt in ([151936], [-1], [10**30], [1, 2, 3.5], [[1, 2]]):
        error_of(post(small, comp, {"model": MODEL, "prompt": prompt}), 400, "prompt")
    # a million ids (2 MB): refused by their count, never decoded
    r, seconds = timed(post, small, comp, {"model": MODEL, "prompt": [9] * 1_000_000})
    assert error_of(r, 400, "prompt")["code"] == "context_length_exceeded"
    assert seconds < 10, seconds
    ids = model.tokenizer.encode("The capital of France is")
    out = post(small, comp, {"model": MODEL, "prompt": ids, "max_tokens": 3,
                             "temperature": 0})
    assert "Paris" in out.json()["choices"][0]["text"]


def test_degenerate_text_is_answered(small):
    """A lone surrogate (JSON allows "\\ud800"), NULs, one character repeated to
    fill the context: answers, not errors."""
    for content in ("\ud800 hi", "\x00" * 50, "é" * 100, "\n" * 300):
        r = post(small, "/v1/chat/completions",
                 json.dumps(chat_body(content, max_tokens=2)))
        assert r.status_code == 200, (content[:5], r.text[:200])
    r = post(small, "/v1/completions", {"model": MODEL, "prompt": "a" * 1000,
                                        "max_tokens": 2})
    assert r.status_code == 200, r.text[:200]
    wait_idle(small)


def test_a_client_that_stops_mid_body(small):
    """Content-Length says 1,000 bytes; 10 arrive and the connection closes.  The
    server drops the request and goes on."""
    for sent in (b'{"model": ', b""):
        with socket.create_connection(address(small), timeout=5) as sock:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                         b"Content-Type: application/json\r\nContent-Length: 1000\r\n"
                         b"\r\n" + sent)
            time.sleep(0.2)
    time.sleep(0.3)
    assert httpx.get(small.url + "/health").json()["status"] == "ok"
    reply = client_of(small).chat.completions.create(
        model=MODEL, max_tokens=8, temperature=0,
        messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert "Paris" in reply.choices[0].message.content
    wait_idle(small)


# --- failures inside the engine -------------------------------------------------------

@pytest.mark.parametrize("where", ["Scheduler._finish", "Turn.finish"])
def test_a_failing_finish_ends_only_that_job(small, monkeypatch, where):
    """`_finish` raising (the end of a turn), or the turn's own `finish` inside it:
    that job gets an error answer, its slot is reset (a consistent, empty
    conversation), and the next request is answered as before."""
    from fucina_course import scheduler

    client = client_of(small)
    wait_idle(small)
    before = client.chat.completions.create(
        model=MODEL, max_tokens=6, temperature=0,
        messages=[{"role": "user", "content": "What is 2 + 2?"}])

    def broken(*args, **kw):
        raise RuntimeError("injected fault in _finish")

    if where == "Scheduler._finish":
        monkeypatch.setattr(small.scheduler, "_finish", broken)
    else:
        monkeypatch.setattr(scheduler.Turn, "finish", broken)
    with pytest.raises(openai.InternalServerError) as info:
        client.chat.completions.create(
            model=MODEL, max_tokens=6, temperature=0,
            messages=[{"role": "user", "content": "What is 2 + 2?"}])
    assert "injected fault in _finish" in info.value.message
    chunks = client.chat.completions.create(
        model=MODEL, max_tokens=6, temperature=0, stream=True,
        messages=[{"role": "user", "content": "What is 2 + 2?"}])
    with pytest.raises(openai.APIError, match="injected fault"):
        list(chunks)
    monkeypatch.undo()
    wait_idle(small)
    assert small.scheduler.alive
    for slot in small.scheduler.slots:        # the ids listed are the ids cached
        assert len(slot.conv.tokens) == slot.conv.cache.len
    after = client.chat.completions.create(
        model=MODEL, max_tokens=6, temperature=0,
        messages=[{"role": "user", "content": "What is 2 + 2?"}])
    assert after.choices[0].message.content == before.choices[0].message.content


def test_a_failing_prefill_ends_only_that_job(small, monkeypatch):
    from fucina_course import scheduler

    def broken(self, chunk=None):
        raise ValueError("injected fault in prefill")

    monkeypatch.setattr(scheduler.Turn, "prefill", broken)
    r = post(small, "/v1/chat/completions", chat_body("Name a color."))
    assert "injected fault in prefill" in error_of(r, 500)["message"]
    monkeypatch.undo()
    r = post(small, "/v1/chat/completions", chat_body("Name a color."))
    assert r.status_code == 200 and small.scheduler.alive
    wait_idle(small)


def test_a_fault_in_the_engine_loop_stops_server_run(model, monkeypatch):
    """A bug in the loop itself (outside every job): the request gets an error,
    and `Server.run()` returns within seconds by raising a one-line
    `FucinaError`, instead of serving 503 forever."""
    server = Server(model, model_id=MODEL, port=0, parallel=1, ctx=128)

    def broken():
        raise RuntimeError("injected fault in the loop")

    monkeypatch.setattr(server.scheduler, "_admit", broken)
    thread, out = in_background(server.run)
    deadline = time.monotonic() + 30
    while server._uvicorn is None or not server._uvicorn.started:
        assert time.monotonic() < deadline and thread.is_alive(), out
        time.sleep(0.05)
    r = post(server, "/v1/chat/completions", chat_body("hi"), timeout=30)
    assert r.status_code in (500, 503)
    t0 = time.monotonic()
    thread.join(15)
    assert not thread.is_alive() and time.monotonic() - t0 < 10
    error = out.get("error")
    assert isinstance(error, FucinaError), out
    assert str(error) == ("the engine thread failed (RuntimeError: injected fault in "
                          "the loop); the server stopped")
    with pytest.raises(httpx.ConnectError):
        httpx.get(server.url + "/health", timeout=2)


def test_the_command_exits_with_one_line_when_the_engine_dies():
    """`fucina serve` with a fault injected into the engine loop: the first
    request kills the loop, and the process ends with status 1 and one line."""
    code = ("import sys\n"
            "from fucina_course import cli, scheduler\n"
            "def broken(self):\n"
            "    raise RuntimeError('injected fault in the loop')\n"
            "scheduler.Scheduler._admit = broken\n"
            "sys.exit(cli.main(sys.argv[1:]))\n")
    proc = subprocess.Popen([sys.executable, "-c", code, "serve", MODEL, "--port",
                             "0", "--parallel", "1", "--ctx", "128"],
                            stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stderr.readline()
        assert "serving qwen2.5-coder-0.5b at http://127.0.0.1:" in line, line
        url = line.split(" at ")[1].split()[0]
        r = httpx.post(url + "/chat/completions", json=chat_body("hi"), timeout=30)
        assert r.status_code in (500, 503)
        t0 = time.monotonic()
        assert proc.wait(timeout=15) == 1
        assert time.monotonic() - t0 < 10
        rest = proc.stderr.read().strip().splitlines()
        assert rest[-1] == ("fucina: error: the engine thread failed (RuntimeError: "
                            "injected fault in the loop); the server stopped")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
