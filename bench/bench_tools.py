"""What tool calling costs: requests per minute through `fucina serve`, and the
grammar's cost per token, each against the same work without tools.

    python bench/bench_tools.py [--model qwen2.5-coder-0.5b] [--requests 12] [--repeats 5]

Two measurements, on one model and thread count, nothing else running:

1. Requests per minute, sequential, through the official `openai` client against an
   in-process `Server` (one slot): a weather question with one tool and
   `tool_choice="required"` (the answer is a grammar-constrained call), against the
   same question with no tools and `max_tokens` set to the call's length (so both
   decode as many tokens; the prompt without tools is shorter by the tool listing,
   which the first request of each kind prefills).
2. The grammar's cost per decoded token, in the engine: the same conversation (the
   tools rendered, greedy) decoded with the grammar's processor and without it
   (the default model then writes the call's JSON without its tags: about as many
   tokens, and a step's cost does not depend on which token it feeds); the
   difference of the decode seconds per token is what the mask costs (llguidance's
   mask plus its unpacking).  Best of `--repeats`, the two interleaved.
"""

from __future__ import annotations

import argparse
import platform
import time

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city"]}}}
QUESTION = [{"role": "user", "content": "What's the weather like in Paris today?"}]


def requests_per_minute(model, n: int) -> dict:
    import openai

    from fucina_course.server import Server

    out = {}
    with Server(model, model_id="m", port=0, parallel=1, ctx=1024) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        first = client.chat.completions.create(
            model="m", messages=QUESTION, tools=[WEATHER], tool_choice="required",
            temperature=0, max_tokens=60)
        n_call = first.usage.completion_tokens
        kinds = {
            "tools": dict(tools=[WEATHER], tool_choice="required", max_tokens=60),
            "plain": dict(max_tokens=n_call)}
        for kind, kw in kinds.items():
            client.chat.completions.create(model="m", messages=QUESTION, temperature=0,
                                           **kw)                      # warm
            t0, tokens = time.perf_counter(), 0
            for _ in range(n):
                r = client.chat.completions.create(model="m", messages=QUESTION,
                                                   temperature=0, **kw)
                tokens += r.usage.completion_tokens
            seconds = time.perf_counter() - t0
            out[kind] = (60 * n / seconds, tokens / n)
    return out


def grammar_cost(model, repeats: int) -> dict:
    from fucina_course.chat import Conversation
    from fucina_course.sampler import SamplerConfig

    def run(grammar: bool) -> float:
        conv = Conversation(model, sampler=SamplerConfig.greedy(), capacity=1024,
                            tools=[WEATHER], tool_choice="required",
                            max_response_tokens=60)
        if not grammar:
            conv.tools.processor = lambda follow_up=False: None
        reply = conv.send(QUESTION[0]["content"])
        assert reply.tool_calls or not grammar, reply.raw_text
        return reply.decode_seconds / len(reply.ids)

    run(True), run(False)                                                 # warm
    best = {True: float("inf"), False: float("inf")}
    for _ in range(repeats):
        for grammar in (True, False):
            best[grammar] = min(best[grammar], run(grammar))
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    from fucina_course.catalog import load_model
    from fucina_course.quant import isa

    model = load_model(args.model)
    cost = grammar_cost(model, args.repeats)
    rpm = requests_per_minute(model, args.requests)
    print(f"{args.model}, {platform.processor() or platform.machine()}, level "
          f"{isa.level}, {time.strftime('%Y-%m-%d')}")
    print("| measurement | with tools | without | ratio |")
    print("|---|---:|---:|---:|")
    (t_rpm, t_tok), (p_rpm, p_tok) = rpm["tools"], rpm["plain"]
    print(f"| requests per minute (one slot; {t_tok:.0f} / {p_tok:.0f} tokens each) | "
          f"{t_rpm:.1f} | {p_rpm:.1f} | {t_rpm / p_rpm:.2f} |")
    g, f = cost[True] * 1e3, cost[False] * 1e3
    print(f"| decode ms per token (grammar / none), best of {args.repeats} | {g:.2f} | "
          f"{f:.2f} | {g / f:.2f} |")
    print(f"grammar cost per token: {g - f:+.2f} ms "
          f"({100 * (g - f) / f:+.1f}% of a step)")


if __name__ == "__main__":
    main()
