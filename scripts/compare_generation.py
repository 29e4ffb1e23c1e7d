"""Record what every generation path writes, to compare two versions of the engine.

Issue 44 rebuilt the decode loop (generation.py) under `Model.generate`, chat, the
server's scheduler and speculative decoding.  Its acceptance: greedy and seeded
outputs equal before and after, on the default model and a synthetic Qwen3.  This
script runs each path with fixed prompts, seeds and limits and writes the ids and
texts as JSON; run it in a checkout of each version and compare:

    git worktree add /tmp/before <rev>
    (cd /tmp/before && /work/main/.venv/bin/python /work/main/scripts/compare_generation.py --out /tmp/before.json)
    .venv/bin/python scripts/compare_generation.py --out /tmp/after.json --compare /tmp/before.json

It uses only the API both sides have (Model.generate, Conversation, send_batch,
Scheduler/Job, the `fucina generate` and `fucina chat` commands), and imports the
engine of the current directory.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

sys.path.insert(0, os.getcwd())

from fucina_course.catalog import resolve  # noqa: E402
from fucina_course.chat import Conversation  # noqa: E402
from fucina_course.model import Model  # noqa: E402
from fucina_course.sampler import Sampler, SamplerConfig  # noqa: E402
from fucina_course.scheduler import Job, Scheduler  # noqa: E402
from fucina_course.speculative import PromptLookup, Speculator  # noqa: E402
from fucina_course.synth import TINY_QWEN3, cached_synthetic  # noqa: E402

QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.",
             "Repeat exactly: one two three, one two three, one two three."]
SEEDED = SamplerConfig(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05)


def paths(model) -> dict:
    """Every generation path on `model`, each a JSON-able record of its output."""
    tok, out = model.tokenizer, {}
    prompt = tok.encode("The capital of France is")
    out["generate"] = model.generate(prompt, 24, stop_ids=set())
    out["generate_stop"] = model.generate(prompt, 40)
    out["generate_full"] = model.generate(prompt, 40, stop_ids=set(),
                                          cache=model.new_cache(len(prompt) + 9))
    for name, config in (("greedy", SamplerConfig.greedy()),
                         ("seeded", SEEDED.with_(seed=7))):
        for limit in (None, 5):
            conv = Conversation(model, sampler=config, capacity=512,
                                max_response_tokens=limit or 48)
            out[f"chat_{name}_{limit}"] = [_reply(conv.send(q)) for q in QUESTIONS]
        spec = Conversation(model, sampler=config, capacity=512, max_response_tokens=48,
                            speculator=Speculator(PromptLookup(), 7))
        out[f"chat_{name}_lookup"] = [_reply(spec.send(q)) for q in QUESTIONS]
        convs = [Conversation(model, sampler=config.with_(seed=s) if s else config,
                              capacity=512, max_response_tokens=24) for s in (1, 2, 3)]
        out[f"batch_{name}"] = [_reply(r) for r in
                                Conversation.send_batch(convs, QUESTIONS)]
    out["scheduler"] = _scheduled(model)
    return out


def _reply(reply) -> dict:
    return dict(text=reply.text, ids=reply.ids, stop=reply.stop_reason)


def _scheduled(model) -> list:
    """Four jobs over two slots (one seeded), prompts sharing a prefix."""
    sched = Scheduler(model, parallel=2, capacity=512).start()
    fmt, tok = sched.format, model.tokenizer
    results, done = {}, threading.Semaphore(0)
    jobs = []
    for i, q in enumerate(QUESTIONS + QUESTIONS[:1]):
        text = fmt.render([{"role": "user", "content": q}])
        config = SEEDED.with_(seed=i) if i % 2 else SamplerConfig.greedy()
        pieces: list[str] = []

        def sink(kind, payload, i=i, pieces=pieces):
            if kind == "text":
                pieces.append(payload)
                return
            results[i] = (["".join(pieces), _reply(payload)] if kind == "done"
                          else ["error", str(payload)])
            done.release()

        jobs.append(Job(tok.encode_raw(text), text, Sampler(config), sink,
                        max_tokens=20 + 4 * i))
    for job in jobs:
        sched.submit(job)
    for _ in jobs:
        done.acquire(timeout=300)
    sched.shutdown()
    return [results.get(i) for i in range(len(jobs))]


def cli(model_path: str) -> dict:
    """The commands, as a reader types them (greedy, and with lookup speculation)."""
    def run(*args) -> str:
        r = subprocess.run([sys.executable, "-m", "fucina_course", *args],
                           capture_output=True, text=True, timeout=600, cwd=os.getcwd())
        return r.stdout if r.returncode == 0 else f"status {r.returncode}: {r.stderr}"

    code = "def add(a, b):\n    return a + b\n\ndef sub(a, b):"
    return {"generate": run("generate", model_path, "--prompt", code, "--gen", "24"),
            "generate_lookup": run("generate", model_path, "--prompt", code, "--gen",
                                   "24", "--speculate", "lookup"),
            "chat": run("chat", model_path, QUESTIONS[0], "--temp", "0"),
            "chat_seeded": run("chat", model_path, QUESTIONS[1], "--seed", "3",
                               "--max-tokens", "24")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--compare", help="a JSON file written by another version")
    args = ap.parse_args()
    record = {}
    for name, path in (("synthetic", cached_synthetic(TINY_QWEN3)),
                       ("default", resolve("qwen2.5-coder-0.5b"))):
        print(f"{name}: {path}", file=sys.stderr)
        model = Model.load(path)
        record[name] = paths(model)
        record[name]["cli"] = cli(str(path))
    Path(args.out).write_text(json.dumps(record, indent=1))
    if not args.compare:
        return 0
    before = json.loads(Path(args.compare).read_text())
    differ = [f"{m}/{k}" for m in record for k in record[m]
              if record[m][k] != before.get(m, {}).get(k)]
    for m in record:
        for k in record[m]["cli"]:
            if record[m]["cli"][k] != before[m]["cli"][k]:
                differ.append(f"{m}/cli/{k}")
    print("identical" if not differ else "differ: " + ", ".join(differ))
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
