"""`fucina serve`, driven the way its users drive it: the official `openai` client.

The servers run in this process (server.Server.start: uvicorn in a thread, the
engine thread beside it) over one model loaded once, so that several servers with
different settings cost no extra load; one test starts the real command in a
subprocess for the CLI and SIGTERM.  Answers are short (a few tokens): the suite is
about the protocol, batching and load, not about the model.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import numpy as np
import pytest

openai = pytest.importorskip("openai")

from fucina_course.chat import ChatFormat, Conversation          # noqa: E402
from fucina_course.sampler import SamplerConfig                  # noqa: E402
from fucina_course.scheduler import _ExactPrefill                # noqa: E402
from fucina_course.server import FIELDS, Access, Server           # noqa: E402
from fucina_course.server.schema import (ChatRequest, CompletionRequest,  # noqa: E402
                                         ResponsesRequest)
from fucina_course.text_stream import ThinkSplitter              # noqa: E402

MODEL = "qwen2.5-coder-0.5b"
QUESTION = "What is the capital of France?"
CTX = 384


@pytest.fixture(scope="module")
def model(coder_model):
    return coder_model


@pytest.fixture(scope="module")
def server(model):
    with Server(model, model_id=MODEL, port=0, parallel=4, ctx=CTX,
                max_body=64 << 10, prefill_chunk=16) as s:
        yield s


@pytest.fixture(scope="module")
def single(model):
    """One slot, one place in the queue: the load tests."""
    with Server(model, model_id=MODEL, port=0, parallel=1, ctx=CTX,
                queue_size=1) as s:
        yield s


def client_of(server, **kw) -> "openai.OpenAI":
    return openai.OpenAI(base_url=server.url + "/v1", api_key=kw.pop("api_key", "none"),
                         max_retries=0, timeout=120, **kw)


def ask(client, question=QUESTION, **kw):
    kw.setdefault("temperature", 0)
    kw.setdefault("max_tokens", 10)
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": question}], **kw)


def streamed(client, question=QUESTION, **kw) -> tuple[str, list]:
    kw.setdefault("temperature", 0)
    kw.setdefault("max_tokens", 10)
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": question}], stream=True,
        **kw))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, chunks


def wait_idle(server, timeout=10.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        health = httpx.get(server.url + "/health").json()
        if health["busy"] == health["waiting"] == health["preparing"] == 0:
            return health
        assert time.monotonic() < deadline, f"slots still busy: {health}"
        time.sleep(0.05)


# --- the routes -------------------------------------------------------------------------

def test_models_and_health(server):
    client = client_of(server)
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    health = httpx.get(server.url + "/health").json()
    assert health["status"] == "ok" and health["slots"] == 4
    assert health["capacity"] == CTX


def test_plain_chat_is_the_engines_answer(server, model):
    reply = ask(client_of(server), max_tokens=12)
    # the engine's conversation, prefilling row by row as the server does (its
    # 36-token prompt went through the server in chunks of 16: the same numbers)
    conv = Conversation(_ExactPrefill(model), sampler=SamplerConfig.greedy(),
                        capacity=CTX, max_response_tokens=12)
    alone = conv.send(QUESTION)
    choice = reply.choices[0]
    assert choice.message.content == alone.text
    assert "Paris" in choice.message.content
    assert choice.message.role == "assistant"
    assert choice.finish_reason == "stop"
    # real token counts: the rendered prompt, and every sampled token (the answer's
    # ids and the end marker)
    fmt = ChatFormat(model.tokenizer)
    prompt = model.tokenizer.encode_raw(
        fmt.render([{"role": "user", "content": QUESTION}]))
    assert reply.usage.prompt_tokens == len(prompt)
    assert reply.usage.completion_tokens == len(alone.ids) + 1
    assert reply.usage.total_tokens == len(prompt) + len(alone.ids) + 1


def test_stream_equals_plain_and_reports_usage(server):
    client = client_of(server)
    plain = ask(client, seed=7, max_tokens=6)
    text, chunks = streamed(client, seed=7, max_tokens=6,
                            stream_options={"include_usage": True})
    assert text == plain.choices[0].message.content
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) >= 3
    finals = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finals[-1] == "length" and set(finals[:-1]) == {None}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    assert chunks[-1].usage.prompt_tokens == plain.usage.prompt_tokens


def test_stop_strings_and_sampling_knobs(server):
    client = client_of(server)
    reply = ask(client, stop=[" of"], max_tokens=10)
    assert reply.choices[0].message.content == "The capital"
    assert reply.choices[0].finish_reason == "stop"
    text, _ = streamed(client, stop=" of", max_tokens=10)
    assert text == "The capital"
    # the knobs reach the sampler: seeded sampling is repeatable, and llama.cpp's
    # extras (top_k, min_p, repeat_penalty) are accepted
    kw = dict(temperature=1.0, seed=3, top_p=0.9, max_tokens=5, presence_penalty=0.5,
              frequency_penalty=0.5,
              extra_body={"top_k": 20, "min_p": 0.05, "repeat_penalty": 1.1})
    a = ask(client, "Name a color.", **kw).choices[0].message.content
    b = ask(client, "Name a color.", **kw).choices[0].message.content
    assert a == b and a


def test_completions_plain_and_streamed(server, model):
    client = client_of(server)
    prompt = "The capital of France is"
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4,
                                      temperature=0)
    ids = model.tokenizer.encode(prompt)
    # the server prefills row by row as decode steps would (scheduler._ExactPrefill), so
    # the reference does too: after " Paris." the default model's top two logits are
    # 0.04-0.05 apart, closer than the batched prefill's attention (a different
    # summation order) moves them
    cache = model.new_cache(len(ids) + 4)
    logits, expected = model.forward_step(ids, 0, cache, per_row=True), []
    for _ in range(4):
        expected.append(int(np.argmax(logits)))
        logits = model.forward_step(expected[-1:], cache.len, cache)
    assert plain.choices[0].text == model.tokenizer.decode(expected)
    assert "Paris" in plain.choices[0].text
    assert plain.choices[0].finish_reason == "length"
    assert plain.usage.prompt_tokens == len(ids) and plain.usage.completion_tokens == 4
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=4,
                                            temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == plain.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_responses_plain_and_streamed(server):
    client = client_of(server)
    kw = dict(model=MODEL, input=QUESTION, instructions="Answer in one sentence.",
              max_output_tokens=8, temperature=0)
    plain = client.responses.create(**kw)
    assert "Paris" in plain.output_text
    assert plain.status in ("completed", "incomplete")
    assert plain.usage.output_tokens <= 8 and plain.usage.input_tokens > 10
    events = list(client.responses.create(stream=True, **kw))
    types = [e.type for e in events]
    assert types[0] == "response.created" and types[-1] in (
        "response.completed", "response.incomplete")
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == plain.output_text
    assert events[-1].response.output_text == plain.output_text
    # messages as input
    again = client.responses.create(model=MODEL, max_output_tokens=8, temperature=0,
                                    input=[{"role": "system",
                                            "content": "Answer in one sentence."},
                                           {"role": "user", "content": [
                                               {"type": "input_text",
                                                "text": QUESTION}]}])
    assert again.output_text == plain.output_text


def test_row_by_row_prefill_does_not_depend_on_the_split(model):
    """Why the scheduler prefills row by row: whatever part of a prompt a slot had
    cached, and however it is chunked, the logits are the same bits."""
    exact = _ExactPrefill(model)
    ids = model.tokenizer.encode_raw(ChatFormat(model.tokenizer).render(
        [{"role": "user", "content": QUESTION}]))[:20]
    whole = exact.forward_step(ids, 0, model.new_cache(32))
    for splits in ([13], [19], [5, 11, 17], list(range(1, 20))):
        cache = model.new_cache(32)
        for a, b in zip([0] + splits, splits + [len(ids)]):
            logits = exact.forward_step(ids[a:b], a, cache)
        assert np.array_equal(logits, whole), splits


# --- batching -----------------------------------------------------------------------------

PROMPTS = ["What is the capital of France?", "What is 2 + 2?",
           "Name a primary color.", "Write a Python comment."]


def test_concurrent_greedy_streams_equal_one_at_a_time(server):
    client = client_of(server)
    wait_idle(server)
    alone = [ask(client, p, max_tokens=8).choices[0].message.content for p in PROMPTS]
    before = dict(server.scheduler.snapshot())
    texts: list = [None] * len(PROMPTS)
    start = threading.Barrier(len(PROMPTS))

    def run(i):
        start.wait()
        texts[i], _ = streamed(client, PROMPTS[i], max_tokens=8)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert texts == alone
    after = server.scheduler.snapshot()
    # they were decoded together: some steps carried several requests' rows
    assert after["max_rows"] >= 2
    assert after["rows"] - before["rows"] > after["steps"] - before["steps"]


def test_prefix_reuse_across_requests(server):
    client = client_of(server)
    wait_idle(server)
    system = ("You are a terse assistant for a geography quiz. " * 8).strip()
    msgs = lambda q: [{"role": "system", "content": system},   # noqa: E731
                      {"role": "user", "content": q}]
    first = client.chat.completions.create(model=MODEL, messages=msgs("Capital of Peru?"),
                                           max_tokens=2, temperature=0)
    before = server.scheduler.snapshot()["prefilled"]
    second = client.chat.completions.create(model=MODEL,
                                            messages=msgs("Capital of Chile?"),
                                            max_tokens=2, temperature=0)
    prefilled = server.scheduler.snapshot()["prefilled"] - before
    cached = second.usage.prompt_tokens_details.cached_tokens
    n_system = len(server.scheduler.model.tokenizer.encode_raw(system))
    # the system prompt (and the template's markers around it) came from a slot's
    # cache: only the new question was prefilled
    assert cached > n_system
    assert prefilled == second.usage.prompt_tokens - cached
    assert prefilled < 15 < first.usage.prompt_tokens


# --- bad input ------------------------------------------------------------------------------

def post(server, path, body, **kw):
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(server.url + path, content=data,
                      headers={"Content-Type": "application/json"}, timeout=60, **kw)


def is_openai_error(r, status, param=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


def test_bad_input_gets_openai_errors_and_the_server_goes_on(server):
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2}
    is_openai_error(post(server, "/v1/chat/completions", '{"model": '), 400)
    is_openai_error(post(server, "/v1/chat/completions", "[1, 2]"), 400)
    is_openai_error(post(server, "/v1/chat/completions", {**chat, "max_tokens": "5"}),
                    400, "max_tokens")
    is_openai_error(post(server, "/v1/chat/completions", {**chat, "stream": "yes"}),
                    400, "stream")
    is_openai_error(post(server, "/v1/chat/completions",
                         {**chat, "messages": [{"role": "user", "content": 5}]}),
                    400, "messages[0].content")
    is_openai_error(post(server, "/v1/chat/completions", {"model": MODEL}), 400,
                    "messages")
    nan = json.dumps(chat)[:-1] + ', "temperature": NaN}'
    is_openai_error(post(server, "/v1/chat/completions", nan), 400, "temperature")
    is_openai_error(post(server, "/v1/chat/completions", {**chat, "top_p": 0}), 400,
                    "top_p")
    is_openai_error(post(server, "/v1/chat/completions", {**chat, "n": 9}), 400, "n")
    is_openai_error(post(server, "/v1/chat/completions",
                         {**chat, "messages": [{"role": "tool", "content": "x"}]}),
                    400, "messages[0].role")
    is_openai_error(post(server, "/v1/chat/completions",
                         {**chat, "messages": [{"role": "user", "content": [
                             {"type": "image_url", "image_url": {"url": "x"}}]}]}),
                    400, "messages[0].content[0]")
    long = {**chat, "messages": [{"role": "user", "content": "word " * (CTX + 10)}]}
    err = is_openai_error(post(server, "/v1/chat/completions", long), 400, "messages")
    assert err["code"] == "context_length_exceeded"
    is_openai_error(post(server, "/v1/completions",
                         {"model": MODEL, "prompt": "x " * (CTX + 10)}), 400, "prompt")
    is_openai_error(post(server, "/v1/chat/completions", b"{" + b" " * (65 << 10) + b"}"),
                    413)
    is_openai_error(post(server, "/v1/chat/completions", {**chat, "model": "gpt-9"}),
                    404, "model")
    is_openai_error(post(server, "/v1/nothing", chat), 404)
    # the official client raises its own classes for them
    client = client_of(server)
    with pytest.raises(openai.BadRequestError):
        ask(client, max_tokens=0)
    with pytest.raises(openai.BadRequestError):
        ask(client, max_completion_tokens=0)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", max_tokens=-1)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-9", max_tokens=2,
                                       messages=[{"role": "user", "content": "hi"}])
    # and the server still answers
    assert "Paris" in ask(client, max_tokens=8).choices[0].message.content
    assert httpx.get(server.url + "/health").json()["status"] == "ok"


# --- the request schema: every documented field honoured, a no-op, or refused ---------

def test_the_field_table_is_the_request_models():
    """`FIELDS` is the one place that says what a field does: the pydantic models
    hold exactly its honoured rows."""
    models = {"chat": ChatRequest, "completion": CompletionRequest,
              "responses": ResponsesRequest}
    assert set(models) == set(FIELDS)
    for kind, rules in FIELDS.items():
        honoured = {name for name, rule in rules.items() if rule.kind == "honoured"}
        assert honoured == set(models[kind].model_fields), kind
        for name, rule in rules.items():
            assert rule.kind in ("honoured", "no-op", "refused"), (kind, name)
            assert rule.kind != "refused" or (None in rule.neutral and rule.why)
    # every documented field of each route is in the table (the `openai` client's
    # own list of them: the keys of its request parameters)
    from openai.types import completion_create_params as cp
    from openai.types.chat import completion_create_params as ccp
    from openai.types.responses import response_create_params as rcp

    for kind, params in (("chat", ccp.CompletionCreateParamsBase),
                         ("completion", cp.CompletionCreateParamsBase),
                         ("responses", rcp.ResponseCreateParamsBase)):
        documented = set(params.__annotations__) | {"stream"}
        missing = documented - set(FIELDS[kind])
        assert not missing, (kind, missing)


@pytest.mark.parametrize("route, field, value", [
    ("responses", "top_logprobs", 3),
    ("chat", "functions", [{"name": "f"}]),       # the deprecated API (tools: served)
    ("chat", "function_call", "auto"), ("chat", "modalities", ["text", "audio"]),
    ("chat", "reasoning_effort", "high"), ("chat", "service_tier", "flex"),
    ("chat", "prediction", {"type": "content", "content": "x"}),
    ("completion", "best_of", 2), ("completion", "echo", True),
    ("completion", "suffix", "}"),
    ("responses", "previous_response_id", "resp_1"),
    ("responses", "reasoning", {"effort": "high"}), ("responses", "truncation", "auto"),
    ("responses", "background", True), ("responses", "include", ["reasoning"]),
    ("responses", "conversation", "conv_1"),
])
def test_documented_but_unsupported_fields_are_refused_by_name(server, route, field,
                                                                value):
    client = client_of(server)
    create = {"chat": lambda **kw: ask(client, max_tokens=2, **kw),
              "completion": lambda **kw: client.completions.create(
                  model=MODEL, prompt="x", max_tokens=2, **kw),
              "responses": lambda **kw: client.responses.create(
                  model=MODEL, input="x", max_output_tokens=2, **kw)}[route]
    with pytest.raises(openai.BadRequestError) as info:
        create(extra_body={field: value})
    assert info.value.param == field and info.value.code == "unsupported_parameter"
    assert f"'{field}' is not supported" in info.value.message


def test_neutral_values_and_no_ops_are_accepted(server):
    client = client_of(server)
    reply = ask(client, max_tokens=8, n=1, logprobs=False, tool_choice="none",
                parallel_tool_calls=False, service_tier="auto", store=True,
                metadata={"k": "v"}, user="u", modalities=["text"],
                safety_identifier="s", prompt_cache_key="p",
                extra_body={"tools": [], "top_logprobs": 0, "verbosity": "medium"})
    assert "Paris" in reply.choices[0].message.content
    out = client.completions.create(model=MODEL, prompt="The capital of France is",
                                    max_tokens=3, temperature=0, n=1, best_of=1,
                                    echo=False, user="u")
    assert "Paris" in out.choices[0].text
    resp = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=8,
                                   temperature=0, store=False, truncation="disabled",
                                   background=False, include=[], metadata={},
                                   tools=[], parallel_tool_calls=False)
    assert "Paris" in resp.output_text


def test_fields_outside_the_schema_are_ignored_and_logged(server, caplog):
    client = client_of(server)
    with caplog.at_level("WARNING", logger="fucina.serve"):
        reply = client.chat.completions.create(
            model=MODEL, max_tokens=8, temperature=0,
            messages=[{"role": "user", "content": QUESTION, "name": "ann"}],
            extra_body={"mirostat": 2, "cache_prompt": True, "best_of": 3,
                        "chat_template_kwargs": {"tools_in_user": 1}})
    assert "Paris" in reply.choices[0].message.content
    warned = [r.getMessage() for r in caplog.records if "ignored" in r.getMessage()]
    assert len(warned) == 1, warned
    message = warned[0]
    assert message.startswith("The following fields were present in the request "
                              "but ignored: ")
    for name in ("mirostat", "cache_prompt", "best_of", "messages[0].name",
                 "chat_template_kwargs.tools_in_user"):
        assert f"'{name}'" in message, (name, message)
    assert "POST /v1/chat/completions" in message


# --- logit_bias -----------------------------------------------------------------------

def test_logit_bias_steers_the_answer(server, model):
    tok = model.tokenizer
    client = client_of(server)
    plain = ask(client, max_tokens=8).choices[0].message.content
    first = tok.encode_raw(plain)[0]                     # "The"
    # +100 on one token: the greedy answer is that token, over and over
    forced = tok.encode_raw(" banana")[0]
    reply = ask(client, max_tokens=3, logit_bias={str(forced): 100})
    assert reply.choices[0].message.content == tok.decode([forced] * 3)
    # -100 on the greedy answer's first token: another answer, never that token
    banned = ask(client, max_tokens=8, logit_bias={str(first): -100})
    text = banned.choices[0].message.content
    assert text != plain and first not in tok.encode_raw(text)
    # the completions route too (a prompt given as ids)
    ids = tok.encode("The capital of France is")
    out = client.completions.create(model=MODEL, prompt=ids, max_tokens=2,
                                    temperature=0, logit_bias={str(forced): 100})
    assert out.choices[0].text == tok.decode([forced] * 2)


@pytest.mark.parametrize("bias", [{"abc": 1}, {"-3": 1}, {"99999999": 1},
                                  {"151936": 1}, {"5": 101}, {"5": -100.5},
                                  {"5": "1"}, {"5": True}, [[5, 1]], "x"])
def test_invalid_logit_bias_is_a_400_naming_it(server, bias):
    r = post(server, "/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2, "logit_bias": bias})
    is_openai_error(r, 400, "logit_bias")


# --- browsers: Origin and Host --------------------------------------------------------

def test_a_page_of_another_origin_cannot_use_the_server(server):
    """A `text/plain` POST is a "simple" request (no preflight): any page could
    send it.  Refused before it is read, and the job never runs."""
    before = server.scheduler.snapshot()
    body = json.dumps({"model": MODEL, "max_tokens": 2,
                       "messages": [{"role": "user", "content": "hi"}]})
    for origin in ("http://evil.example", "null", "http://127.0.0.1:1",
                   "http://localhost.evil.example:" + str(server.port)):
        r = httpx.post(server.url + "/v1/chat/completions", content=body,
                       headers={"Content-Type": "text/plain", "Origin": origin})
        err = is_openai_error(r, 403)
        assert err["code"] == "origin_not_allowed"
        assert "access-control-allow-origin" not in r.headers
    r = httpx.options(server.url + "/v1/chat/completions", headers={
        "Origin": "http://evil.example", "Access-Control-Request-Method": "POST"})
    assert r.status_code == 403
    after = server.scheduler.snapshot()
    assert (after["jobs"], after["prefilled"]) == (before["jobs"], before["prefilled"])
    # the server's own origins are allowed (and get CORS headers)
    own = f"http://localhost:{server.port}"
    r = httpx.post(server.url + "/v1/chat/completions", content=body,
                   headers={"Content-Type": "text/plain", "Origin": own}, timeout=60)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == own
    # clients that send no Origin (curl, the openai client) are unaffected
    assert ask(client_of(server), max_tokens=2).choices[0].message.content


def test_allowed_origins_get_cors(model):
    page = "http://app.example:3000"
    with Server(model, model_id=MODEL, port=0, parallel=1, ctx=CTX, api_key="k",
                cors_origins=[page + "/"]) as s:
        r = httpx.options(s.url + "/v1/chat/completions", headers={
            "Origin": page, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type, "
                                              "x-stainless-os"})
        assert r.status_code == 204, r.text            # no API key on a preflight
        h = r.headers
        assert h["access-control-allow-origin"] == page
        assert "POST" in h["access-control-allow-methods"]
        allowed = {v.strip().lower()
                   for v in h["access-control-allow-headers"].split(",")}
        assert {"authorization", "content-type", "x-stainless-os"} <= allowed
        assert int(h["access-control-max-age"]) > 0
        assert "Origin" in h["vary"]
        r = httpx.post(s.url + "/v1/chat/completions", timeout=60, headers={
            "Origin": page, "Authorization": "Bearer k"}, json={
            "model": MODEL, "max_tokens": 2, "temperature": 0,
            "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == page
        assert "Origin" in r.headers["vary"]
        r = httpx.get(s.url + "/v1/models", headers={"Origin": page})   # no key
        assert r.status_code == 401 and r.headers["access-control-allow-origin"] == page
        assert httpx.get(s.url + "/health", headers={
            "Origin": "http://other.example"}).status_code == 403
    with Server(model, model_id=MODEL, port=0, parallel=1, ctx=CTX,
                cors_origins=["*"]) as s:
        r = httpx.get(s.url + "/health", headers={"Origin": "http://any.example"})
        assert r.headers["access-control-allow-origin"] == "http://any.example"


def test_dns_rebinding_is_refused_by_the_host_check(server):
    for host in ("evil.example", f"evil.example:{server.port}", "10.0.0.1",
                 "127.0.0.1.evil.example", "localhost.evil.example"):
        r = httpx.get(server.url + "/v1/models", headers={"Host": host})
        assert is_openai_error(r, 403)["code"] == "host_not_allowed", host
    for host in ("localhost", f"localhost:{server.port}", "app.localhost:1",
                 "127.0.0.2", f"[::1]:{server.port}", "LOCALHOST."):
        assert httpx.get(server.url + "/v1/models",
                         headers={"Host": host}).status_code == 200, host


def test_host_rules():
    on_loopback = Access("127.0.0.1", 8080, allow_hosts=["box.lan:1234"])
    assert on_loopback.host_allowed("box.lan:8080") and on_loopback.host_allowed(None)
    assert not on_loopback.host_allowed("other.lan")
    exposed = Access("0.0.0.0", 8080)                    # the user exposed the port
    assert exposed.host_allowed("box.lan") and exposed.host_allowed("evil.example")
    named = Access("0.0.0.0", 8080, allow_hosts=["box.lan"])
    assert named.host_allowed("box.lan") and named.host_allowed("localhost:8080")
    assert not named.host_allowed("evil.example")
    assert Access("127.0.0.1", 8080, allow_hosts=["*"]).host_allowed("evil.example")
    own = Access("::1", 80)
    assert own.origin_allowed("http://[::1]") and own.origin_allowed("http://localhost")
    assert not own.origin_allowed("http://localhost:81")


def test_the_cli_checks_the_browser_flags_before_loading():
    bad = subprocess.run([sys.executable, "-m", "fucina_course", "serve", MODEL,
                          "--cors-origins", "http://ok.example,localhost:3000"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and "Traceback" not in bad.stderr
    assert bad.stderr.strip().splitlines() == [
        "fucina: error: --cors-origins: 'localhost:3000' is not an origin "
        "(scheme://host[:port], e.g. http://localhost:3000, or *)"]


# --- load: the queue, cancellation, the key ---------------------------------------------------

def open_stream(server, question, max_tokens):
    """A raw streaming request, started and read up to its first content chunk."""
    http = httpx.Client(timeout=60)
    body = {"model": MODEL, "messages": [{"role": "user", "content": question}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True}
    cm = http.stream("POST", server.url + "/v1/chat/completions", json=body)
    response = cm.__enter__()
    assert response.status_code == 200
    return http, cm, response


def test_full_slots_and_queue_answer_429(single):
    wait_idle(single)
    http_a, cm_a, a = open_stream(single, "Count from 1 to 100.", 300)
    lines = a.iter_lines()
    next(line for line in lines if '"content": "' in line and '""' not in line)
    http_b, cm_b, b = open_stream(single, "Count from 1 to 50.", 300)   # queued
    health = httpx.get(single.url + "/health").json()
    assert (health["busy"], health["waiting"]) == (1, 1)
    client = client_of(single)
    with pytest.raises(openai.RateLimitError) as info:
        ask(client, max_tokens=2)
    assert info.value.response.headers["retry-after"] == "1"
    assert info.value.response.json()["error"]["code"] == "rate_limit_exceeded"
    for cm, http in ((cm_b, http_b), (cm_a, http_a)):
        cm.__exit__(None, None, None)
        http.close()
    wait_idle(single)


def test_a_client_that_disconnects_frees_its_slot(single):
    wait_idle(single)
    rows = single.scheduler.snapshot()["rows"]
    http, cm, response = open_stream(single, "Count from 1 to 200.", 400)
    lines = response.iter_lines()
    for _ in range(3):
        next(line for line in lines if '"content"' in line)
    t0 = time.monotonic()
    cm.__exit__(None, None, None)                     # the client goes away
    http.close()
    health = wait_idle(single, timeout=5)
    freed = time.monotonic() - t0
    assert health["cancelled"] >= 1
    assert health["rows"] - rows < 100            # it did not run to its 400 tokens
    assert freed < 5
    # the one slot is free: a new request runs at once (a full slot would queue it)
    reply = ask(client_of(single), max_tokens=8)
    assert "Paris" in reply.choices[0].message.content
    # a non-streaming request abandoned by its client is cancelled too, though its
    # tokens keep coming (the connection is checked every 0.25 s regardless)
    before = single.scheduler.snapshot()
    try:
        httpx.post(single.url + "/v1/chat/completions", timeout=1.0, json={
            "model": MODEL, "max_tokens": 400, "temperature": 0,
            "messages": [{"role": "user",     # 292 tokens at greedy, ~6 s
                          "content": "List the numbers from 1 to 200, one per line."}]})
    except httpx.TimeoutException:
        pass
    health = wait_idle(single, timeout=5)
    assert health["cancelled"] == before["cancelled"] + 1
    assert health["rows"] - before["rows"] < 150


def test_api_key(model):
    with Server(model, model_id=MODEL, port=0, parallel=1, ctx=CTX,
                api_key="sekrit") as s:
        assert httpx.get(s.url + "/health").status_code == 200
        for key in ("none", "sekri", "sekrit2"):
            with pytest.raises(openai.AuthenticationError):
                client_of(s, api_key=key).models.list()
        r = httpx.get(s.url + "/v1/models")
        is_openai_error(r, 401)
        assert r.json()["error"]["code"] == "invalid_api_key"
        r = post(s, "/v1/chat/completions", {"model": MODEL, "messages": []})
        assert r.status_code == 401
        client = client_of(s, api_key="sekrit")
        assert [m.id for m in client.models.list().data] == [MODEL]
        assert ask(client, max_tokens=3).choices[0].message.content


# --- structured output ------------------------------------------------------------------------

def test_response_format_json_schema(server):
    pytest.importorskip("fucina_course.grammar")
    jsonschema = pytest.importorskip("jsonschema")
    schema = {"type": "object", "properties": {"capital": {"type": "string",
                                                           "maxLength": 12}},
              "required": ["capital"], "additionalProperties": False}
    client = client_of(server)
    for temperature in (0, 1.0):
        reply = ask(client, "What is the capital of France? Answer in JSON.",
                    max_tokens=24, temperature=temperature, seed=1, response_format={
                        "type": "json_schema",
                        "json_schema": {"name": "answer", "schema": schema}})
        assert reply.choices[0].finish_reason == "stop"
        value = json.loads(reply.choices[0].message.content)
        jsonschema.validate(value, schema)
    r = post(server, "/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}],
        "response_format": {"type": "json_schema", "json_schema": {
            "schema": {"type": "string", "pattern": "(?=a)b"}}}})
    is_openai_error(r, 400, "response_format")


# --- thinking ---------------------------------------------------------------------------------

@pytest.mark.parametrize("raw, reasoning, content", [
    ("<think>\nLet me see.\n</think>\n\nParis.", "Let me see.", "Paris."),
    ("<think>\n\n</think>\n\nParis.", "", "Paris."),
    ("Paris.", "", "Paris."),
    ("<think>\nstill thinking", "still thinking", ""),
    ("a <thin b", "", "a <thin b"),
])
def test_think_block_goes_to_reasoning_content(raw, reasoning, content):
    whole = ThinkSplitter()
    r, c = whole.push(raw)
    r2, c2 = whole.finish()
    assert (r + r2, c + c2) == (reasoning, content)
    # piece by piece (as streamed deltas), the same text, never half a tag shown
    split, rs, cs = ThinkSplitter(), [], []
    for ch in raw:
        r, c = split.push(ch)
        rs.append(r)
        cs.append(c)
        assert "<" not in c or "<thin" in content
    r, c = split.finish()
    assert ("".join(rs) + r, "".join(cs) + c) == (reasoning, content)


def test_a_template_that_opens_the_think_block():
    split = ThinkSplitter(thinking=True)
    r, c = split.push("I know this.\n</think>\n\nParis.")
    r2, c2 = split.finish()
    assert (r + r2, c + c2) == ("I know this.", "Paris.")


def test_qwen3_thinking_goes_to_reasoning_content(monkeypatch):
    """A Qwen3 vocabulary (a one-layer synthetic model, the real tokenizer) made to
    answer "<think>...</think>" and text: the block is `reasoning_content`, in the
    answer and in the stream, never `content`; enable_thinking=False reaches the
    chat format (the empty think block is pre-filled: a longer prompt)."""
    from fucina_course import synth
    from fucina_course.model import Model
    from fucina_course.sampler import Sampler

    qwen3 = Model.load(synth.cached_synthetic(
        synth.SynthSpec(name="tiny-qwen3-full-vocab", num_layers=1)))
    tok = qwen3.tokenizer
    answer = tok.encode_raw("<think>\nLet me see.\n</think>\n\nParis.")
    end = tok.token_id("<|im_end|>")

    def forcing(*_):
        calls = [0]

        def processor(logits, history):
            i, calls[0] = calls[0], calls[0] + 1
            forced = np.full_like(logits, -np.inf)
            forced[answer[i] if i < len(answer) else end] = 0.0
            return forced

        def sampler(*args, **kw):
            return Sampler(SamplerConfig.greedy(), logit_processor=processor)
        return sampler

    with Server(qwen3, model_id="q3", port=0, parallel=2, ctx=128) as s:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0)
        msgs = [{"role": "user", "content": QUESTION}]
        monkeypatch.setattr(s.app, "_sampler", forcing())
        reply = client.chat.completions.create(model="q3", messages=msgs)
        message = reply.choices[0].message
        assert (message.content, message.reasoning_content) == ("Paris.", "Let me see.")
        assert reply.usage.completion_tokens == len(answer) + 1
        monkeypatch.setattr(s.app, "_sampler", forcing())
        chunks = list(client.chat.completions.create(model="q3", messages=msgs,
                                                     stream=True))
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        assert "".join(d.content or "" for d in deltas) == "Paris."
        assert "".join(getattr(d, "reasoning_content", None) or ""
                       for d in deltas) == "Let me see."
        assert not any("think>" in (d.content or "") for d in deltas)
        monkeypatch.setattr(s.app, "_sampler", forcing())
        off = client.chat.completions.create(
            model="q3", messages=msgs, max_tokens=3,
            extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        fmt = ChatFormat(tok)
        assert off.usage.prompt_tokens == len(tok.encode_raw(fmt.render(
            msgs, no_think=True))) == reply.usage.prompt_tokens + 4


# --- the command ------------------------------------------------------------------------------

def test_fucina_serve_command_and_sigterm(coder_path):
    bad = subprocess.run([sys.executable, "-m", "fucina_course", "serve", MODEL,
                          "--parallel", "0"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and "Traceback" not in bad.stderr
    assert bad.stderr.strip() == "fucina: error: --parallel must be at least 1, got 0"
    proc = subprocess.Popen([sys.executable, "-m", "fucina_course", "serve", MODEL,
                             "--port", "0", "--parallel", "2", "--ctx", str(CTX)],
                            stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stderr.readline()
        assert "serving qwen2.5-coder-0.5b at http://127.0.0.1:" in line, line
        url = line.split(" at ")[1].split()[0]
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0)
        stream = client.chat.completions.create(
            model=MODEL, stream=True, max_tokens=300, temperature=0,
            messages=[{"role": "user", "content": "Count from 1 to 100."}])
        first = [next(stream) for _ in range(3)]
        assert first[0].choices[0].delta.role == "assistant"
        proc.send_signal(signal.SIGTERM)
        with pytest.raises(openai.APIError):   # the stream ends with the reason
            for _ in stream:
                pass
        assert proc.wait(timeout=20) == 0
        rest = proc.stderr.read()
        assert "Traceback" not in rest and "server stopped" in rest
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


if os.environ.get("FUCINA_SERVE_DEBUG"):   # pragma: no cover - local runs
    import logging

    logging.basicConfig(level=logging.INFO)


def test_non_text_content_is_refused_alike_on_both_apis(server):
    """Chat messages (pydantic parts) and Responses items (plain dicts) go through one
    content rule: text parts are joined, anything else is a 400 naming the part."""
    image = {"type": "image_url", "image_url": {"url": "http://x/y.png"}}
    text = {"type": "text", "text": "hi"}
    chat = {"model": MODEL, "max_tokens": 2,
            "messages": [{"role": "user", "content": [text, image]}]}
    err = is_openai_error(post(server, "/v1/chat/completions", chat), 400,
                          "messages[0].content[1]")
    assert "'image_url'" in err["message"]
    item = {"role": "user", "content": [{"type": "input_text", "text": "hi"},
                                        {"type": "input_image", "image_url": "x"}]}
    err = is_openai_error(post(server, "/v1/responses",
                               {"model": MODEL, "input": [item], "max_output_tokens": 2}),
                          400, "input[0].content[1]")
    assert "'input_image'" in err["message"]
    for bad in (5, [5], None):
        r = post(server, "/v1/responses", {"model": MODEL, "max_output_tokens": 2,
                                           "input": [{"role": "user", "content": bad}]})
        is_openai_error(r, 400)
    ok = post(server, "/v1/responses", {"model": MODEL, "max_output_tokens": 2, "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "Say "},
                                     {"type": "input_text", "text": "hi"}]}]})
    assert ok.status_code == 200, ok.text


# --- the answers, without HTTP; and the stream's keep-alive --------------------------------

def test_the_answers_are_the_openai_clients_types():
    """The response objects and stream events are built by plain functions
    (server/answers.py): called here on a reply and a job's events, each parses as
    the `openai` client's own type for it."""
    import asyncio
    from types import SimpleNamespace

    from openai.types import Completion
    from openai.types.chat import ChatCompletion, ChatCompletionChunk
    from openai.types.responses import Response, ResponseStreamEvent
    from pydantic import TypeAdapter

    from fucina_course.errors import ContextFull
    from fucina_course.server import answers
    from fucina_course.server.schema import ResponsesRequest

    reply = SimpleNamespace(raw_text="<think>\nHm.\n</think>\n\nParis.", ids=[1, 2, 3],
                            stop_reason="end", reused=5)
    meta = {"id": "chatcmpl-1", "created": 1, "model": MODEL}
    whole = ChatCompletion.model_validate(answers.chat_completion(meta, reply, 9, True,
                                                                  False))
    assert whole.choices[0].message.content == "Paris."
    assert whole.usage.completion_tokens == 4 and whole.usage.total_tokens == 13
    assert Completion.model_validate(answers.text_completion(
        {**meta, "id": "cmpl-1"}, reply, 9)).choices[0].finish_reason == "stop"

    async def events(*items):
        for item in items:
            yield item

    async def collect(stream):
        return [event async for event in stream]

    sent = asyncio.run(collect(answers.chat_events(
        events(("text", "Par"), ("text", "is."), ("done", reply)), meta, 9,
        split=True, thinking=False, include_usage=True)))
    assert sent[-1] == {"data": "[DONE]"}
    chunks = [ChatCompletionChunk.model_validate_json(e["data"]) for e in sent[:-1]]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) \
        == "Paris."
    assert chunks[-1].usage.prompt_tokens == 9
    failed = asyncio.run(collect(answers.completion_events(
        events(("error", ContextFull("full")),), meta, 9, include_usage=False)))
    assert json.loads(failed[0]["data"])["error"]["code"] == "context_length_exceeded"
    state = answers.ResponseState(
        id="resp_1", msg="msg_" + "0" * 24, created=1.0, model=MODEL, n_prompt=9,
        req=ResponsesRequest(model=MODEL, input="hi"), split=True, thinking=False)
    sent = asyncio.run(collect(answers.response_events(
        events(("text", "Paris."), ("done", reply)), state)))
    # (the usage is left out: the client's ResponseUsage, newer than this server's,
    # requires input_tokens_details.cache_write_tokens, which is not sent; the
    # client itself reads its answers leniently)
    bodies = [json.loads(e["data"]) for e in sent]
    for body in bodies:
        (body.get("response") or {}).pop("usage", None)
    parsed = [TypeAdapter(ResponseStreamEvent).validate_python(b) for b in bodies]
    assert [e["event"] for e in sent] == [p.type for p in parsed]
    assert parsed[-1].type == "response.completed"
    assert parsed[-1].response.output_text == "Paris."
    final = answers.response_object(state, reply)
    assert final["usage"]["input_tokens_details"] == {"cached_tokens": 5}
    final.pop("usage")
    assert Response.model_validate(final).output_text == "Paris."


def test_keepalive_pings_leave_clients_unaffected(server, monkeypatch):
    """sse-starlette sends a comment line (": ping - <time>") whenever a stream has
    been quiet for PING_SECONDS, so that a proxy keeps it open; SSE clients skip
    comments, the `openai` client included: it reads the same answer."""
    from fucina_course.server import stream

    client = client_of(server)
    plain = ask(client, max_tokens=8).choices[0].message.content
    monkeypatch.setattr(stream, "PING_SECONDS", 0.01)
    text, _ = streamed(client, max_tokens=8)
    assert text == plain
    raw = post(server, "/v1/chat/completions", {
        "model": MODEL, "max_tokens": 8, "temperature": 0, "stream": True,
        "messages": [{"role": "user", "content": QUESTION}]}).text
    assert "\n: ping - " in raw and raw.endswith("data: [DONE]\n\n")
