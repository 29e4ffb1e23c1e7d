"""Speculative decoding: decode tokens/s with and without it, per draft length.

    python bench/bench_speculative.py [MODEL] [--threads 2] [--draft 2,4,8,12]
        [--tokens 160] [--repeats 2] [--speculate lookup] [--markdown]

A fixed, held-in set of prompts of two kinds (`PROMPTS`): *code edits* (rewrite a
function with one change: most of the answer copies the prompt, where prompt lookup
shines) and *free prose* (little to copy).  Each is rendered as one chat turn and
decoded greedily for at most `--tokens` tokens, plainly and with `--speculate` at
each draft length.  Greedy speculation must give the same tokens (checked; a
difference aborts the run).

Protocol: one warm-up generation; then for each prompt and setting, the best of
`--repeats` runs.  Decode speed = (tokens - 1) / (time from the first token to the
last): the prefill (the same in both) and the first token it yields are left out.
Runs are sequential in one process, so nothing else competes for the two cores; a
machine line names the CPU and the kernels' instruction-set level.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time

FUNCTION = '''def parse_config(path):
    """Read a key=value config file into a dict."""
    result = {}
    with open(path) as f:
        for line_number, line in enumerate(f, start=1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            if "=" not in line:
                raise ValueError(f"line {line_number}: expected key=value")
            key, value = line.split("=", 1)
            key = key.strip()
            value = value.strip()
            if not key:
                raise ValueError(f"line {line_number}: empty key")
            if key in result:
                raise ValueError(f"line {line_number}: duplicate key {key}")
            if value.lower() in ("true", "false"):
                value = value.lower() == "true"
            elif value.isdigit():
                value = int(value)
            result[key] = value
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
                     "function. Reply with the whole function only.\n\n```python\n"
                     + FUNCTION + "```"),
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

    family = getattr(isa, "cpu_family", lambda: platform.processor())()
    return f"{family}, kernels at {isa.level}"


def timed(run) -> tuple[list[int], float]:
    """(tokens, decode seconds after the first token)."""
    marks: list[float] = []
    out = run(lambda tok: marks.append(time.perf_counter()))
    return out, (marks[-1] - marks[0]) if len(marks) > 1 else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", nargs="?", default="qwen2.5-coder-0.5b")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--draft", default="2,4,8,12")
    ap.add_argument("--tokens", type=int, default=160)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--speculate", default="lookup")
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args()

    from fucina_course.catalog import load_model, resolve
    from fucina_course.chat import render_prompt
    from fucina_course.speculative import generate, make_speculator

    model = load_model(resolve(args.model), threads=args.threads)
    drafts = [int(x) for x in args.draft.split(",")]
    tok = model.tokenizer
    model.generate(tok.encode("warm up"), 8)
    rows = []
    for name, (kind, text) in PROMPTS.items():
        ids = tok.encode_raw(render_prompt(tok, text))
        best = {}
        plain_out = None
        for _ in range(args.repeats):
            out, sec = timed(lambda on: model.generate(ids, args.tokens, on_token=on))
            plain_out = out
            best["plain"] = min(best.get("plain", float("inf")), sec)
        stats = {}
        for k in drafts:
            for _ in range(args.repeats):
                spec = make_speculator(args.speculate, model, draft_max=k)
                out, sec = timed(lambda on: generate(model, ids, args.tokens, spec,
                                                     on_token=on))
                if out != plain_out:
                    sys.exit(f"{name}, draft {k}: speculation changed the tokens")
                best[k] = min(best.get(k, float("inf")), sec)
                stats[k] = spec.stats
        n = len(plain_out) - 1
        rows.append((name, kind, n, n / best["plain"],
                     {k: (n / best[k], best["plain"] / best[k], stats[k].acceptance,
                          stats[k].steps) for k in drafts}))
        print(f"{name}: {n + 1} tokens, plain {n / best['plain']:.1f} tok/s; "
              + "; ".join(
            f"draft {k}: {n / best[k]:.1f} tok/s x{best['plain'] / best[k]:.2f} "
            f"({100 * stats[k].acceptance:.0f}% accepted, {stats[k].steps} steps)"
            for k in drafts), flush=True)
    print(f"\n{args.model}, {args.speculate}, greedy, {args.tokens} tokens max, "
          f"{machine()}, {time.strftime('%Y-%m-%d')}")
    if args.markdown:
        head = "| prompt | tokens | plain tok/s | " + " | ".join(
            f"draft {k}" for k in drafts) + " |"
        print(head)
        print("|" + "---|" * (3 + len(drafts)))
        for name, _, n, plain, per in rows:
            cells = " | ".join(f"{s:.2f}x ({100 * a:.0f}%)" for _, s, a, _ in
                               (per[k] for k in drafts))
            print(f"| {name} | {n + 1} | {plain:.1f} | {cells} |")
    for kind in ("code", "prose"):
        for k in drafts:
            sp = [per[k][1] for _, kd, _, _, per in rows if kd == kind]
            print(f"{kind}, draft {k}: median speed-up x{statistics.median(sp):.2f}")


if __name__ == "__main__":
    main()
