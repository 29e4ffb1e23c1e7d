"""Speculative decoding: decode tokens/s with and without it, per draft length.

    python bench/bench_speculative.py [MODEL] [--threads 2] [--draft 3,7,15]
        [--tokens 400] [--repeats 2] [--speculate lookup] [--temp T --seed S]
        [--markdown]

A fixed, held-in set of prompts of two kinds (`PROMPTS`): *code edits* (rewrite a
40-line function with one change: most of the answer copies the prompt, where prompt
lookup shines) and *free prose* (little to copy).  Each is one chat turn
(`Conversation.send`), answered in at most `--tokens` tokens, plainly and with
`--speculate` at each draft length; greedy by default, or sampled with `--temp T
--seed S`.  With a deterministic drafter the answer must be the same ids in both
(checked; a difference aborts the run).  Greedy prose from a 0.5B model soon loops
(it repeats its own sentences, which lookup then copies): the sampled run is the
fair picture of free prose.

Protocol: one warm-up answer; then for each prompt and setting, the best of
`--repeats` runs.  Decode speed = `Reply.decode_tokens_per_second`: answer tokens
over the time from the end of the prefill (the same in both) to the last token.
Runs are sequential in one process, so nothing else competes for the two cores; a
machine line names the CPU and the kernels' instruction-set level.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

FUNCTION = '''def parse_config(path, defaults=None):
    """Read a key=value config file into a dict of typed values."""
    result = dict(defaults or {})
    section = None
    with open(path, encoding="utf-8") as f:
        for line_number, line in enumerate(f, start=1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            if line.startswith("[") and line.endswith("]"):
                section = line[1:-1].strip()
                if not section:
                    raise ValueError(f"line {line_number}: empty section name")
                continue
            if "=" not in line:
                raise ValueError(f"line {line_number}: expected key=value")
            key, value = line.split("=", 1)
            key = key.strip()
            value = value.strip()
            if not key:
                raise ValueError(f"line {line_number}: empty key")
            if section:
                key = f"{section}.{key}"
            if key in result and key not in (defaults or {}):
                raise ValueError(f"line {line_number}: duplicate key {key}")
            if value.lower() in ("true", "false"):
                value = value.lower() == "true"
            elif value.isdigit():
                value = int(value)
            elif value.startswith('"') and value.endswith('"'):
                value = value[1:-1]
            else:
                try:
                    value = float(value)
                except ValueError:
                    pass
            result[key] = value
    if not result:
        raise ValueError(f"{path}: no settings found")
    return result
'''

CLASS = '''class Inventory:
    def __init__(self):
        self.items = {}

    def add(self, name, count=1):
        if count <= 0:
            raise ValueError("count must be positive")
        self.items[name] = self.items.get(name, 0) + count

    def remove(self, name, count=1):
        have = self.items.get(name, 0)
        if count > have:
            raise KeyError(f"only {have} of {name} left")
        if count == have:
            del self.items[name]
        else:
            self.items[name] = have - count

    def total(self):
        return sum(self.items.values())
'''

PROMPTS = {
    "code: rename": ("code", "Rename the variable `result` to `settings` in this "
                     "40-line function. Reply with the whole function only.\n\n"
                     "```python\n" + FUNCTION + "```"),
    "code: docstrings": ("code", "Add a one-line docstring to each method of this "
                         "class. Reply with the whole class only.\n\n```python\n"
                         + CLASS + "```"),
    "prose: story": ("prose", "Write a short story about a lighthouse keeper who "
                     "finds a message in a bottle."),
    "prose: explain": ("prose", "Explain why the sky is blue to a ten-year-old, in "
                       "two paragraphs."),
}


def machine() -> str:
    from fucina_course.quant import isa

    return f"{isa.cpu_family()}, kernels at {isa.level}"


def answer(model, text, tokens, config, speculator):
    """One chat answer (at most `tokens` tokens): its ids and decode tokens/s (from the
    end of the prefill to the last token: `Reply.decode_tokens_per_second`)."""
    from fucina_course.chat import Conversation

    conv = Conversation(model, sampler=config, max_response_tokens=tokens,
                        speculator=speculator)
    reply = conv.send(text)
    return reply.ids, reply.decode_tokens_per_second


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", nargs="?", default="qwen2.5-coder-0.5b")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--draft", default="3,7,15")
    ap.add_argument("--tokens", type=int, default=400)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--speculate", default="lookup")
    ap.add_argument("--temp", type=float, default=0.0,
                    help="sampling temperature (default 0: greedy)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args()

    from fucina_course.catalog import load_model, resolve
    from fucina_course.sampler import SamplerConfig
    from fucina_course.commands import make_speculator

    model = load_model(resolve(args.model), threads=args.threads)
    drafts = [int(x) for x in args.draft.split(",")]
    config = (SamplerConfig.greedy() if args.temp <= 0 else
              SamplerConfig.qwen3(thinking=False).with_(temperature=args.temp,
                                                        seed=args.seed))
    mode = "greedy" if args.temp <= 0 else f"T={args.temp}, seed {args.seed}"
    answer(model, "warm up", 8, config, None)
    rows = []
    for name, (kind, text) in PROMPTS.items():
        best, stats, plain_ids = {}, {}, None
        for _ in range(args.repeats):
            plain_ids, rate = answer(model, text, args.tokens, config, None)
            best["plain"] = max(best.get("plain", 0.0), rate)
        for k in drafts:
            for _ in range(args.repeats):
                spec = make_speculator(args.speculate, model, draft_max=k)
                ids, rate = answer(model, text, args.tokens, config, spec)
                if ids != plain_ids:
                    sys.exit(f"{name}, draft {k}: speculation changed the tokens")
                best[k] = max(best.get(k, 0.0), rate)
                stats[k] = spec.stats
        n = len(plain_ids)
        rows.append((name, kind, n, best["plain"],
                     {k: (best[k], best[k] / best["plain"], stats[k].acceptance,
                          stats[k].steps) for k in drafts}))
        print(f"{name}: {n} tokens, plain {best['plain']:.1f} tok/s; " + "; ".join(
            f"draft {k}: {best[k]:.1f} tok/s x{best[k] / best['plain']:.2f} "
            f"({100 * stats[k].acceptance:.0f}% accepted, {stats[k].steps} steps)"
            for k in drafts), flush=True)
    print(f"\n{args.model}, {args.speculate}, {mode}, {args.tokens} tokens max, "
          f"{machine()}, {time.strftime('%Y-%m-%d')}")
    if args.markdown:
        head = "| prompt | tokens | plain tok/s | " + " | ".join(
            f"draft {k}" for k in drafts) + " |"
        print(head)
        print("|" + "---|" * (3 + len(drafts)))
        for name, _, n, plain, per in rows:
            cells = " | ".join(f"{s:.2f}x ({100 * a:.0f}%)" for _, s, a, _ in
                               (per[k] for k in drafts))
            print(f"| {name} | {n} | {plain:.1f} | {cells} |")
    for kind in ("code", "prose"):
        for k in drafts:
            sp = [per[k][1] for _, kd, _, _, per in rows if kd == kind]
            print(f"{kind}, draft {k}: median speed-up x{statistics.median(sp):.2f}")


if __name__ == "__main__":
    main()
