"""`GET /metrics` (server/metrics.py) and `reasoning_tokens` (server/answers.py).

One server with an API key over a one-layer synthetic Qwen3 (the real vocabulary,
so <think> and </think> are single tokens), loaded once: the answers are a few
tokens, forced where their content matters.  The exposition text is read with
`prometheus_client`'s own parser, so it is the format Prometheus scrapes.
"""

from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace

import httpx
import numpy as np
import pytest

openai = pytest.importorskip("openai")
parser = pytest.importorskip("prometheus_client.parser")

from fucina_course.sampler import Sampler, SamplerConfig         # noqa: E402
from fucina_course.server import Server, answers, metrics         # noqa: E402

MODEL = "q3"
KEY = "sekrit"
AUTH = {"Authorization": f"Bearer {KEY}"}
THINKING = "<think>\nLet me see.\n</think>\n\nParis."
CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def qwen3():
    from fucina_course import synth
    from fucina_course.model import Model

    return Model.load(synth.cached_synthetic(
        synth.SynthSpec(name="tiny-qwen3-full-vocab", num_layers=1)))


@pytest.fixture(scope="module")
def server(qwen3):
    with Server(qwen3, model_id=MODEL, port=0, parallel=2, ctx=128,
                api_key=KEY, max_body=64 << 10) as s:
        yield s


def scrape(server) -> dict:
    """name -> {(sample name, sorted labels): value}, read by Prometheus' parser."""
    r = httpx.get(server.url + "/metrics")
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    return {f.name: {(s.name, tuple(sorted(s.labels.items()))): s.value
                     for s in f.samples}
            for f in parser.text_string_to_metric_families(r.text)}


def value(families, name, sample=None, **labels) -> float:
    key = (sample or name, tuple(sorted(labels.items())))
    return families[name].get(key, 0)


def requests(families, route, status) -> float:
    return value(families, "fucina_requests", "fucina_requests_total", route=route,
                 status=str(status))


def chat(server, max_tokens=3, **kw):
    return httpx.post(server.url + CHAT, headers=AUTH, timeout=60, json={
        "model": MODEL, "max_tokens": max_tokens, "temperature": 0,
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        **kw})


def check_histogram(families, name) -> float:
    """Buckets cumulative, +Inf == _count; the count."""
    samples = families[name]
    buckets = sorted((float(dict(labels)["le"]), v) for (s, labels), v in samples.items()
                     if s == name + "_bucket")
    counts = [v for _, v in buckets]
    assert counts == sorted(counts), buckets
    assert buckets[-1][0] == float("inf")
    count = samples[(name + "_count", ())]
    assert buckets[-1][1] == count
    assert samples[(name + "_sum", ())] >= 0
    return count


def force(monkeypatch, server, text: str) -> list[int]:
    """The next request's answer is `text` (then the end marker); its ids."""
    tok = server.app.tokenizer
    answer, end = tok.encode_raw(text), tok.token_id("<|im_end|>")
    calls = [0]

    def processor(logits, history):
        i, calls[0] = calls[0], calls[0] + 1
        forced = np.full_like(logits, -np.inf)
        forced[answer[i] if i < len(answer) else end] = 0.0
        return forced

    monkeypatch.setattr(server.app, "_sampler", lambda *a, **kw: Sampler(
        SamplerConfig.greedy(), logit_processor=processor))
    return answer


# --- /metrics ---------------------------------------------------------------------------

def test_counters_move_with_answers_and_errors(server):
    before = scrape(server)
    ok = chat(server, max_tokens=3)
    assert ok.status_code == 200, ok.text
    assert httpx.post(server.url + CHAT, headers=AUTH, content=b"{").status_code == 400
    assert httpx.get(server.url + "/v1/nothing", headers=AUTH).status_code == 404
    assert httpx.get(server.url + "/v1/models").status_code == 401     # no key
    after = scrape(server)
    for route, status in ((CHAT, 200), (CHAT, 400), ("unmatched", 404),
                          ("/v1/models", 401)):
        assert requests(after, route, status) == requests(before, route, status) + 1
    used = ok.json()["usage"]

    def moved(name):
        return value(after, name, name + "_total") - value(before, name, name + "_total")

    assert moved("fucina_prompt_tokens") == used["prompt_tokens"]
    assert moved("fucina_generated_tokens") == used["completion_tokens"]
    assert moved("fucina_prefilled_tokens") + moved(
        "fucina_prefix_cache_reused_tokens") == used["prompt_tokens"]
    assert moved("fucina_jobs_started") == 1
    assert value(after, "fucina_slots") == 2
    assert value(after, "fucina_slots_busy") == value(after, "fucina_queue_waiting") == 0
    assert value(after, "fucina_engine_up") == 1
    for name in ("fucina_time_to_first_token_seconds",
                 "fucina_time_per_output_token_seconds"):
        assert check_histogram(after, name) == check_histogram(before, name) + 1


def test_n_choices_count_their_prompt_once(server):
    before = scrape(server)
    r = chat(server, max_tokens=3, n=2, seed=1, temperature=0.9)
    assert r.status_code == 200, r.text
    used, after = r.json()["usage"], scrape(server)
    name = "fucina_prompt_tokens"
    assert value(after, name, name + "_total") - value(before, name, name + "_total") \
        == used["prompt_tokens"]
    name = "fucina_generated_tokens"
    assert value(after, name, name + "_total") - value(before, name, name + "_total") \
        == used["completion_tokens"]


def test_a_stream_is_counted_once(server):
    before = scrape(server)
    with httpx.stream("POST", server.url + CHAT, headers=AUTH, json={
            "model": MODEL, "max_tokens": 4, "stream": True,
            "messages": [{"role": "user", "content": "Hi"}]}) as r:
        assert r.status_code == 200
        assert "data: [DONE]" in r.read().decode()
    after = scrape(server)
    assert requests(after, CHAT, 200) == requests(before, CHAT, 200) + 1
    name = "fucina_time_to_first_token_seconds"
    assert check_histogram(after, name) == check_histogram(before, name) + 1


def test_metrics_need_no_key_but_keep_the_browser_rules(server):
    assert httpx.get(server.url + "/metrics").status_code == 200           # no key
    assert httpx.get(server.url + "/metrics", headers=AUTH).status_code == 200
    other = httpx.get(server.url + "/metrics", headers={"Origin": "http://evil.test"})
    assert other.status_code == 403
    rebound = httpx.get(server.url + "/metrics", headers={"Host": "evil.test"})
    assert rebound.status_code == 403


def test_hostile_requests_to_metrics(server):
    r = httpx.get(server.url + "/metrics?x=" + "a" * 10240)
    assert r.status_code == 200
    assert any(f.name == "fucina_requests"
               for f in parser.text_string_to_metric_families(r.text))
    before = scrape(server)
    r = httpx.post(server.url + "/metrics", content=b"x" * 1000)
    assert r.status_code == 405
    assert set(r.headers["allow"].split(", ")) == {"GET", "HEAD"}
    err = r.json()["error"]                                  # OpenAI's error shape
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    r = httpx.post(server.url + "/metrics", content=b"x" * (65 << 10))
    assert r.status_code == 413
    after = scrape(server)
    assert requests(after, "/metrics", 405) == requests(before, "/metrics", 405) + 1
    assert requests(after, "/metrics", 413) == requests(before, "/metrics", 413) + 1
    assert httpx.get(server.url + "/health").json()["status"] == "ok"


def test_histograms_and_the_text_format_without_http():
    h = metrics.Histogram((0.1, 1.0))
    for v in (0.1, 0.5, 1.0, 7.0):               # a bound is inclusive (`le`)
        h.observe(v)
    out: list[str] = []
    metrics._histogram(out, "x_seconds", "help", h)
    assert out[2:] == ['x_seconds_bucket{le="0.1"} 1', 'x_seconds_bucket{le="1.0"} 3',
                       'x_seconds_bucket{le="+Inf"} 4', "x_seconds_sum 8.6",
                       "x_seconds_count 4"]
    assert metrics._labels({"route": 'a"b\\c\n'}) == '{route="a\\"b\\\\c\\n"}'


def test_a_failing_observation_never_stops_an_event():
    m = metrics.Metrics(scheduler=None)
    got = []
    sink = m.watch(lambda kind, payload: got.append(kind),
                   arrival=time.perf_counter() - 100)
    sink("text", "Hi")
    sink("done", SimpleNamespace())                   # no fields: observing fails
    assert got == ["text", "done"]
    assert m._ttft.counts[-1] == 1 and sum(m._ttft.counts) == 1   # once, first text


# --- reasoning_tokens -------------------------------------------------------------------

def test_reasoning_tokens_counts_the_think_block():
    think = (10, 11)                                  # <think>, </think>
    assert answers.reasoning_tokens([10, 1, 2, 11, 3, 4], False, think) == 4
    assert answers.reasoning_tokens([1, 2, 11, 3], True, think) == 3   # template opened
    assert answers.reasoning_tokens([1, 2, 3], True, think) == 3       # cut inside it
    assert answers.reasoning_tokens([1, 2, 3], False, think) == 0
    assert answers.reasoning_tokens([1, 10, 2, 11, 3], False, think) == 3
    assert answers.reasoning_tokens([10, 1, 11], False, None) == 0    # cannot think
    reply = SimpleNamespace(raw_text="I know.\n</think>\n\nParis.", ids=[1, 2, 11, 3],
                            stop_reason="end", reused=0)
    body = answers.chat_completion({}, reply, 5, True, True, think)
    assert body["usage"]["completion_tokens_details"] == {"reasoning_tokens": 3}
    assert body["choices"][0]["message"]["reasoning_content"] == "I know."
    assert answers.chat_completion({}, reply, 5, False, True, think)[
        "usage"]["completion_tokens_details"] == {"reasoning_tokens": 0}


def test_usage_counts_reasoning_tokens_of_a_thinking_answer(server, monkeypatch):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0,
                           timeout=60)
    close = server.app.tokenizer.token_id("</think>")
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    answer = force(monkeypatch, server, THINKING)
    expected = answer.index(close) + 1
    reply = client.chat.completions.create(model=MODEL, messages=msgs)
    assert reply.choices[0].message.reasoning_content == "Let me see."
    assert reply.usage.completion_tokens == len(answer) + 1
    assert reply.usage.completion_tokens_details.reasoning_tokens == expected
    force(monkeypatch, server, THINKING)
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=msgs, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == expected
    force(monkeypatch, server, THINKING)
    body = httpx.post(server.url + "/v1/responses", headers=AUTH, timeout=60, json={
        "model": MODEL, "input": "What is the capital of France?"}).json()
    assert body["usage"]["output_tokens_details"] == {"reasoning_tokens": expected}
    # not thinking: 0, whether the model just answers or thinking is switched off
    force(monkeypatch, server, "Paris.")
    plain = client.chat.completions.create(model=MODEL, messages=msgs)
    assert plain.choices[0].message.content == "Paris."
    assert plain.usage.completion_tokens_details.reasoning_tokens == 0
    force(monkeypatch, server, "Paris.")
    off = client.chat.completions.create(
        model=MODEL, messages=msgs,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert off.usage.completion_tokens_details.reasoning_tokens == 0
    force(monkeypatch, server, "Paris.")
    body = httpx.post(server.url + "/v1/responses", headers=AUTH, timeout=60, json={
        "model": MODEL, "input": "What is the capital of France?"}).json()
    assert body["usage"]["output_tokens_details"] == {"reasoning_tokens": 0}


def test_the_usage_chunk_of_a_stream_counts_them_too():
    async def events(*items):
        for item in items:
            yield item

    async def collect(stream):
        return [event async for event in stream]

    reply = SimpleNamespace(raw_text="Hm.\n</think>\n\nParis.", ids=[1, 11, 3],
                            stop_reason="end", reused=0)
    sent = asyncio.run(collect(answers.chat_events(
        events(("text", reply.raw_text), ("done", reply)), {}, 4, split=True,
        thinking=True, include_usage=True, think_ids=(10, 11))))
    usage = json.loads(sent[-2]["data"])["usage"]
    assert usage["completion_tokens_details"] == {"reasoning_tokens": 2}
    assert usage["completion_tokens"] == 4
