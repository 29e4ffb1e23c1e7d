"""Tool calling: OpenAI's chat completions shape, through the official `openai`
client on the default model (its GGUF template renders `tools`), and the parser
(tool_calls.py) against splits of the same text.  The arguments are checked with
`jsonschema`, an independent validator of the functions' own schemas."""

from __future__ import annotations

import json
import random

import pytest

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

from fucina_course.server import Server                             # noqa: E402
from fucina_course.tool_calls import (ToolCallStream, parse_tool_calls,  # noqa: E402
                                      tools_of)

MODEL = "qwen2.5-coder-0.5b"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city"]}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
ASK = [{"role": "user", "content": "What's the weather like in Paris today?"}]


@pytest.fixture(scope="module")
def server(coder_model):
    with Server(coder_model, model_id=MODEL, port=0, parallel=2, ctx=1024) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0,
                         timeout=120)


def chat(client, messages=ASK, **kw):
    kw.setdefault("temperature", 0)
    kw.setdefault("max_tokens", 60)
    return client.chat.completions.create(model=MODEL, messages=messages, **kw)


def valid_call(call, tool):
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == tool["function"]["name"]
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, tool["function"]["parameters"])
    return args


@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                 "function": {"name": "get_weather"}}])
def test_a_forced_call_is_valid_and_says_tool_calls(client, choice):
    reply = chat(client, tools=[CLOCK, WEATHER], tool_choice=choice)
    c = reply.choices[0]
    assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1
    args = valid_call(c.message.tool_calls[0], WEATHER)
    assert args["city"] == "Paris"
    assert c.message.content is None


def test_a_named_function_is_the_one_called(client):
    reply = chat(client, tools=[WEATHER, CLOCK],
                 tool_choice={"type": "function", "function": {"name": "get_time"}})
    valid_call(reply.choices[0].message.tool_calls[0], CLOCK)


def test_streamed_deltas_reassemble_to_the_same_call(client):
    whole = chat(client, tools=[WEATHER], tool_choice="required").choices[0]
    chunks = list(chat(client, tools=[WEATHER], tool_choice="required", stream=True))
    calls, finish = {}, None
    for ch in chunks:
        if not ch.choices:
            continue
        for d in ch.choices[0].delta.tool_calls or []:
            entry = calls.setdefault(d.index, {"id": d.id, "name": "", "arguments": ""})
            entry["name"] += d.function.name or ""
            entry["arguments"] += d.function.arguments or ""
        finish = ch.choices[0].finish_reason or finish
    want = whole.message.tool_calls[0].function
    assert finish == "tool_calls" and len(calls) == 1
    assert (calls[0]["name"], calls[0]["arguments"]) == (want.name, want.arguments)
    assert calls[0]["id"].startswith("call_")


def test_parallel_calls_only_when_asked(client):
    one = chat(client, tools=[WEATHER], tool_choice="required", max_tokens=120)
    assert len(one.choices[0].message.tool_calls) == 1
    many = chat(client, tools=[WEATHER], tool_choice="required", max_tokens=120,
                parallel_tool_calls=True).choices[0]
    calls = many.message.tool_calls
    assert len(calls) >= 2           # the grammar let the model go on (it does)
    for call in calls[:-1] if many.finish_reason == "length" else calls:
        valid_call(call, WEATHER)


def test_the_result_sent_back_is_used(client):
    call = chat(client, tools=[WEATHER], tool_choice="required").choices[0] \
        .message.tool_calls[0]
    history = ([{"role": "system", "content": "You are a helpful assistant. When a "
                 "tool result arrives, answer the user in one plain sentence using it."}]
               + ASK
               + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                  {"role": "tool", "tool_call_id": call.id,
                   "content": json.dumps({"temperature_celsius": 18,
                                          "condition": "sunny"})}])
    answer = chat(client, history, tools=[WEATHER], tool_choice="none")
    text = answer.choices[0].message.content
    assert answer.choices[0].finish_reason == "stop" and not answer.choices[0] \
        .message.tool_calls
    assert "18" in text and "sunny" in text.lower()


def test_none_offers_no_tools_and_auto_calls_only_valid_functions(client):
    plain = chat(client, max_tokens=8)
    none = chat(client, tools=[WEATHER], tool_choice="none", max_tokens=8)
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens   # not rendered
    assert none.choices[0].message.content == plain.choices[0].message.content
    auto = chat(client, tools=[WEATHER], max_tokens=60)
    offered = auto.usage.prompt_tokens
    assert offered > plain.usage.prompt_tokens + 50              # the tools are shown
    for call in auto.choices[0].message.tool_calls or []:
        valid_call(call, WEATHER)


def test_a_stream_dropped_half_way_leaves_the_server_answering(server, client):
    import httpx

    with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=60, json={
            "model": MODEL, "messages": ASK, "tools": [WEATHER], "stream": True,
            "tool_choice": "required", "max_tokens": 60, "temperature": 0}) as r:
        for line in r.iter_lines():
            if "tool_calls" in line:           # the call has begun: hang up
                break
    again = chat(client, tools=[WEATHER], tool_choice="required")
    valid_call(again.choices[0].message.tool_calls[0], WEATHER)


def test_a_call_cut_by_max_tokens_says_length(client):
    reply = chat(client, tools=[WEATHER], tool_choice="required", max_tokens=14)
    c = reply.choices[0]
    assert c.finish_reason == "length" and c.message.tool_calls[0].function.name == \
        "get_weather"


@pytest.mark.parametrize("body, param", [
    ({"tools": "get_weather"}, "tools"),
    ({"tools": [{"type": "function"}]}, "tools[0].function.name"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]},
     "tools[0].function.name"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
    ({"tools": [WEATHER] * 129}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "string", "pattern": "(?=a)"}}}}}],
      "tool_choice": "required"}, "tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function",
                                           "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"messages": [{"role": "user", "content": "hi", "tool_calls": [{"id": "x"}]}]},
     "messages[0].tool_calls"),
    ({"messages": [{"role": "assistant", "content": None,
                    "tool_calls": [{"id": "x", "function": "f"}]}]},
     "messages[0].tool_calls[0]"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
    ({"tools": [{"type": "function", "function": {"name": "a" * 20_000}}]},
     "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {
        "name": "f", "description": "x" * 20_000}}]}, "messages"),   # the context
    ({"messages": ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c", "content": "é" * 20_000}]}, "messages"),
])
def test_hostile_tools_are_a_400_naming_the_field(server, body, param):
    import httpx

    payload = {"model": MODEL, "messages": ASK, "max_tokens": 4, **body}
    r = httpx.post(server.url + "/v1/chat/completions", json=payload, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


# --- the parser, without a model -----------------------------------------------------

TEXT = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": '
        '{"city": "Paris", "where": {"x": [1, "}"]}}}\n</tool_call>\n<tool_call>\n'
        '{"name": "f\\u00e9", "arguments": {}}\n</tool_call>')


def test_the_parse_of_a_whole_answer():
    content, calls = parse_tool_calls(TEXT)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "where": {"x": [1, "}"]}}), ("fé", {})]
    assert parse_tool_calls("no call <tool_ca") == ("no call <tool_ca", [])
    cut = parse_tool_calls('<tool_call>\n{"name": "g", "arguments": {"a": "b')
    assert cut[1][0].name == "g" and cut[1][0].arguments == '{"a": "b'


@pytest.mark.parametrize("seed", range(20))
def test_any_split_of_the_stream_gives_the_whole_parse(seed):
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(TEXT)), rng.randint(1, 40)))
    stream, events = ToolCallStream(), []
    for a, b in zip([0] + cuts, cuts + [len(TEXT)]):
        events += stream.push(TEXT[a:b])
    events += stream.finish()
    content, calls = parse_tool_calls(TEXT)
    args: dict = {}
    for e in events:
        if e[0] == "arguments":
            args[e[1]] = args.get(e[1], "") + e[2]
    assert [args[i] for i in range(len(calls))] == [c.arguments for c in calls]
    assert [e[2] for e in events if e[0] == "call"] == [c.name for c in calls]
    assert "".join(e[1] for e in events if e[0] == "content").strip() == content


def test_tools_of_reads_both_shapes():
    flat = {"type": "function", "name": "get_time",
            "description": CLOCK["function"]["description"],
            "parameters": CLOCK["function"]["parameters"]}
    assert tools_of([CLOCK])[0] == tools_of([flat])[0]


# --- /v1/responses: function_call items ----------------------------------------------

FLAT = {"type": "function", **WEATHER["function"]}


def test_responses_call_a_function_and_stream_it(client):
    whole = client.responses.create(model=MODEL, input=ASK[0]["content"],
                                    tools=[FLAT], tool_choice="required",
                                    temperature=0, max_output_tokens=60)
    calls = [i for i in whole.output if i.type == "function_call"]
    assert whole.status == "completed" and len(calls) == 1
    assert calls[0].name == "get_weather" and calls[0].call_id.startswith("call_")
    jsonschema.validate(json.loads(calls[0].arguments), FLAT["parameters"])
    events = list(client.responses.create(model=MODEL, input=ASK[0]["content"],
                                          tools=[FLAT], tool_choice="required",
                                          temperature=0, max_output_tokens=60,
                                          stream=True))
    numbers = [e.sequence_number for e in events]
    assert numbers == list(range(len(numbers)))
    deltas = "".join(e.delta for e in events
                     if e.type == "response.function_call_arguments.delta")
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    final = events[-1].response
    assert events[-1].type == "response.completed"
    assert deltas == done[0].arguments == calls[0].arguments
    assert [i.type for i in final.output] == ["function_call"]
    assert final.output[0].id == done[0].item_id


def test_responses_take_the_result_back(client):
    call = client.responses.create(model=MODEL, input=ASK[0]["content"], tools=[FLAT],
                                   tool_choice="required", temperature=0,
                                   max_output_tokens=60).output[0]
    answer = client.responses.create(
        model=MODEL, temperature=0, max_output_tokens=60, tools=[FLAT],
        tool_choice="none",
        instructions="You are a helpful assistant. When a tool result arrives, answer "
                     "the user in one plain sentence using it.",
        input=[{"role": "user", "content": ASK[0]["content"]},
               {"type": "function_call", "call_id": call.call_id, "name": call.name,
                "arguments": call.arguments},
               {"type": "function_call_output", "call_id": call.call_id,
                "output": json.dumps({"temperature_celsius": 18,
                                      "condition": "sunny"})}])
    assert "18" in answer.output_text and "sunny" in answer.output_text.lower()


@pytest.mark.parametrize("items, param", [
    ([{"type": "function_call_output", "call_id": "c", "output": "x"}], "input[0].type"),
    ([{"role": "user", "content": "hi"},
      {"type": "function_call", "name": "get_weather", "arguments": "{}"}],
     "input[1].call_id"),
    ([{"role": "user", "content": "hi"}, {"type": "web_search_call"}], "input[1].type"),
])
def test_hostile_response_items_are_a_400(server, items, param):
    import httpx

    r = httpx.post(server.url + "/v1/responses", timeout=60, json={
        "model": MODEL, "input": items, "tools": [FLAT], "max_output_tokens": 4})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


# --- fucina chat / repl --tools -------------------------------------------------------

def run_cli(*args, stdin=None):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "fucina_course", *map(str, args)],
                          capture_output=True, text=True, timeout=300, input=stdin)


def test_the_chat_command_prints_a_valid_call(tmp_path):
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps([WEATHER, CLOCK]))
    r = run_cli("chat", MODEL, ASK[0]["content"], "--tools", tools, "--tool-choice",
                "get_weather", "--temp", "0")
    assert r.returncode == 0, r.stderr
    line = [x for x in r.stderr.splitlines() if x.startswith("[tool call] ")]
    assert len(line) == 1 and line[0].startswith("[tool call] get_weather(")
    args = json.loads(line[0][len("[tool call] get_weather("):-1])
    jsonschema.validate(args, WEATHER["function"]["parameters"])


def test_the_repl_asks_for_each_result_and_goes_on(tmp_path):
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps({"tools": [WEATHER]}))      # a request body works too
    r = run_cli("repl", MODEL, "--tools", tools, "--tool-choice", "required", "--temp",
                "0", "--max-tokens", "40", "--system", "Answer in one sentence.",
                stdin="What is the weather in Rome?\n21 degrees and cloudy\n")
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("result of get_weather> ") >= 1
    assert r.stderr.count("tokens, ") >= 2            # the call, then the answer to it


@pytest.mark.parametrize("content, flags, message", [
    (None, ["--tool-choice", "required"], "--tool-choice needs --tools"),
    ("[", [], "not JSON"),
    ('{"a": 1}', [], "non-empty list"),
    ('[{"type": "function", "function": {"name": "a b"}}]', [], "function name"),
    (json.dumps([WEATHER]), ["--tool-choice", "nope"], "not among the tools"),
    ("missing", [], "cannot read it"),
    ("[" * 20_000, [], "not JSON"),                        # degenerate: deep nesting
    (json.dumps([{"type": "function", "function": {"name": "a" * 20_000}}]), [],
     "function name"),
])
def test_bad_tools_flags_are_one_line_and_exit_1(tmp_path, content, flags, message):
    path = tmp_path / "tools.json"
    if content not in (None, "missing"):
        path.write_text(content)
    args = ["--tools", path] if content is not None else []
    r = run_cli("chat", MODEL, "hi", *args, *flags)
    assert r.returncode == 1 and message in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
