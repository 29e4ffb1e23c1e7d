"""Where the time goes: one decode step and one prefill, split by stage (Model.profile).

    python bench/profile_step.py MODEL [--threads 2] [--prefill 256] [--context 64]

MODEL as for bench_vs_llama.py (a path, a named model, or synth:qwen3-0.6b:FMT).  Decode is
measured at position `--context` (a short conversation), averaged over 32 steps after a
warm-up, first as `forward_step` runs it, then stage by stage (`Model.profile` times each
block: the difference is what the timers cost); prefill is one `--prefill`-token step into a
fresh cache.  Stages are what `Model._timed` wraps: "embedding", "attention" (the whole
attention block: norm, q/k/v, RoPE, KV append, attention, output projection), "ffn" (norm,
gate/up, SwiGLU, down) and "lm_head" (final norm + output).  The weight bytes read per
decode step and the implied GB/s are printed (compare bench/bench_roofline.py's ceiling).
bench/ab_decode.py compares the decode speed of two commits.
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prefill", type=int, default=256)
    ap.add_argument("--context", type=int, default=64)
    args = ap.parse_args()
    os.environ["OPENBLAS_NUM_THREADS"] = str(args.threads)
    sys.path.insert(0, os.path.dirname(__file__))
    from bench_vs_llama import resolve
    from fucina_course.model import Model

    model = Model.load(resolve(args.model), threads=args.threads)
    ids = list(range(1000, 1000 + max(args.prefill, args.context)))

    cache = model.new_cache(args.context + 64)
    model.forward_step(ids[: args.context], 0, cache)
    for _ in range(4):
        model.forward_step([7], cache.len, cache)
    steps = 32

    def decode_seconds() -> float:
        t = time.perf_counter()
        for _ in range(steps):
            model.forward_step([7], cache.len, cache)
        cache.truncate(args.context)
        return (time.perf_counter() - t) / steps

    fast = decode_seconds()            # as `fucina bench` runs it
    model.profile = {}                 # stage by stage
    per_step = decode_seconds()
    weights = sum(p.nbytes for layer in model.layers for p in (*layer.qkv.parts, layer.attn_out)) \
        + sum(layer.ffn.nbytes_per_token for layer in model.layers) + model.output.nbytes
    print(f"decode at position ~{args.context}: {fast * 1e3:.1f} ms/token ({1 / fast:.1f} tok/s), "
          f"{weights / 2**20:.0f} MiB of weights read per token = {weights / fast / 1e9:.1f} GB/s")
    print(f"the same step timed stage by stage (Model.profile): {per_step * 1e3:.1f} ms")
    for stage, secs in sorted(model.profile.items(), key=lambda kv: -kv[1]):
        print(f"  {stage:>15}: {secs / steps * 1e3:6.2f} ms  ({secs / steps / per_step:5.1%})")

    model.forward_step(ids[: args.prefill], 0, model.new_cache(args.prefill))  # warm-up
    model.profile = {}
    t = time.perf_counter()
    model.forward_step(ids[: args.prefill], 0, model.new_cache(args.prefill))
    total = time.perf_counter() - t
    print(f"prefill of {args.prefill} tokens: {total * 1e3:.0f} ms ({args.prefill / total:.1f} tok/s)")
    for stage, secs in sorted(model.profile.items(), key=lambda kv: -kv[1]):
        print(f"  {stage:>15}: {secs * 1e3:7.1f} ms  ({secs / total:5.1%})")


if __name__ == "__main__":
    main()
