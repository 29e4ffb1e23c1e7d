"""`fucina generate`, `logits`, `verify-cache` and `bench`: a model run on a prompt
(or on nothing, to time it), its output, logits or speed reported.  The steps the
commands share (loading the model, the prompt's ids, a cache that fits) are in
commands.py."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from .commands import (cache_for, check_speculation_flags, first_start,
                       load_model_for, prompt_ids, speculator_for)
from .errors import FucinaError


def cmd_generate(args) -> int:
    model = load_model_for(args)
    ids = prompt_ids(model, args)
    if args.gen < 1:
        raise FucinaError("--gen must be at least 1")
    stream = model.tokenizer.stream(skip_special=True) if model.tokenizer else None

    def show(tok: int) -> None:
        if stream is not None:
            sys.stdout.write(stream.push(tok))
            sys.stdout.flush()

    n = min(model.config.context_length, len(ids) + args.gen)
    check_speculation_flags(args)
    cache = cache_for(model, n, args.cache_type)
    from .kv_cache import prompt_fits

    if not prompt_fits(len(ids), cache.capacity):
        raise FucinaError(f"the prompt ({len(ids)} tokens) leaves no room to generate "
                          f"in the model's context of {model.config.context_length} "
                          "positions")
    spec = speculator_for(args, model, n)
    stop_ids = None if not args.ignore_eos else set()
    start = time.perf_counter()
    out = model.generate(ids, args.gen, cache=cache, on_token=show, stop_ids=stop_ids,
                         speculator=spec)
    seconds = time.perf_counter() - start
    if stream is not None:
        sys.stdout.write(stream.flush() + "\n")
    if args.stats:
        line = (f"[{len(out)} tokens in {seconds:.2f} s with the prefill of "
                f"{len(ids)}: {len(out) / seconds:.1f} tok/s]")
        print(line + (f" [{spec.stats.line()}]" if spec else ""), file=sys.stderr)
    if args.ids_out:
        Path(args.ids_out).write_text("".join(f"{i}\n" for i in out))
    return 0


def cmd_logits(args) -> int:
    import numpy as np

    if not (args.ids or args.prompt is not None):
        raise FucinaError("give the input as --ids 1,2,3 or --prompt TEXT")
    model = load_model_for(args)
    ids = prompt_ids(model, args)
    cache = cache_for(model, len(ids), args.cache_type)
    if args.all:
        logits = model.forward_step_all_logits(ids, 0, cache)
    else:
        logits = model.forward_step(ids, 0, cache)
    logits = logits.astype(np.float32)
    if args.out:
        np.save(args.out, logits)
        print(f"wrote {args.out}: float32 {list(logits.shape)}")
    if args.compare:
        path = Path(args.compare)
        if not path.is_file():
            raise FucinaError(f"{path}: no such file")
        ref = np.load(path)
        if ref.shape != logits.shape:
            raise FucinaError(f"{path}: shape {list(ref.shape)} does not match ours "
                              f"{list(logits.shape)}")
        diff = np.abs(logits - ref)
        worst = float(diff.max())
        rel = float(worst / max(float(np.abs(ref).max()), 1e-30))
        span = float(ref.max() - ref.min())
        print(f"max |diff| = {worst:.6g}  (max rel {rel:.3g}, "
              f"{worst / span:.3g} of the logit range)")
        last_ours, last_ref = np.atleast_2d(logits)[-1], np.atleast_2d(ref)[-1]
        print("top-5 ours:", np.argsort(-last_ours)[:5].tolist(),
              " theirs:", np.argsort(-last_ref)[:5].tolist())
        same = np.array_equal(np.atleast_2d(logits).argmax(-1),
                              np.atleast_2d(ref).argmax(-1))
        print(f"argmax identical at every position: {same}")
        if worst > args.tol or not same:
            print(f"fucina: error: logits differ by more than --tol {args.tol}"
                  if same else "fucina: error: argmax differs", file=sys.stderr)
            return 1
    return 0


def cmd_verify_cache(args) -> int:
    from .oracles import verify_cache

    model = load_model_for(args)
    ids = prompt_ids(model, args)
    if args.steps < 0:
        raise FucinaError("--steps must be at least 0")
    cache_for(model, len(ids) + args.steps, args.cache_type)  # context check only
    check = verify_cache(model, ids, args.steps, args.cache_type, fast=not args.no_fast)

    def summary(diff, same) -> str:
        return (f"worst {float(diff.max()):.3g}, "
                f"argmax equal at {int(same.sum())}/{len(same)}")

    print(f"{model.path.name}: {len(ids)}-token prompt, {args.steps} decode steps, "
          f"{args.cache_type} cache")
    for pos, diff, same in zip(check.positions, check.diff, check.argmax_equal):
        print(f"position {pos:5d}: max |cached - uncached| = {diff:.3g}, "
              f"argmax {'equal' if same else 'DIFFERENT'}")
    print(f"like for like: {summary(check.diff, check.argmax_equal)} (checked)")
    if check.fast_diff is not None:
        print(f"fast prefill path: {summary(check.fast_diff, check.fast_argmax_equal)} "
              "(not checked: prefill vs decode numerics)")
    if check.q8_diff is not None:
        print(f"q8_0 vs an f16 cache: {summary(check.q8_diff, check.q8_argmax_equal)} "
              "(not checked: what q8_0 costs)")
    worst = float(check.diff.max())
    if worst > args.tol or not check.argmax_equal.all():
        print(f"fucina: error: cached and uncached logits disagree (worst {worst:.3g}, "
              f"tolerance {args.tol})", file=sys.stderr)
        return 1
    return 0


def cmd_bench(args) -> int:
    import json

    from . import bench

    try:
        pp = [int(x) for x in args.pp.split(",") if x.strip()] if args.pp else []
    except ValueError:
        raise FucinaError(f"--pp must be comma-separated integers, "
                          f"got {args.pp!r}") from None
    model = load_model_for(args)
    first_start(model)
    quiet = args.json

    def progress(message):
        print(f"  {message}", file=sys.stderr)

    result = bench.run(model, pp=pp, tg=args.tg, cache_type=args.cache_type,
                       repeats=args.repeats, streams=args.streams,
                       threads=args.threads or os.cpu_count(),
                       progress=None if quiet else progress)
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{result['model']}  threads={result['threads']}  "
          f"cache={result['cache_type']}")
    for row in result["prefill"]:
        print(f"  prefill pp{row['tokens']:<5d} {row['tok_s']:10.1f} tok/s")
    if "decode" in result:
        d = result["decode"]
        streams = f" ({d['streams']} streams)" if d["streams"] > 1 else ""
        print(f"  decode  tg{d['tokens']:<5d} {d['tok_s']:10.1f} tok/s{streams}")
    if getattr(model, "expert_cache", None) is not None:
        _expert_reads(model, args.tg)
    return 0


def _expert_reads(model, tokens: int) -> None:
    """--expert-cache: what decoding reads from disk, measured on `tokens` more decode
    steps (after the benchmark's own), and what the cache did over the whole run."""
    import time

    cache, st = model.expert_cache, model.expert_cache.stats
    kv = model.new_cache(tokens + 1)
    before, t0 = st.bytes_read, time.perf_counter()
    for i in range(tokens):
        model.forward_step([1000 + 7 * i], kv.len, kv)
    seconds, read = time.perf_counter() - t0, st.bytes_read - before
    print(f"  experts {cache.n_slots} slots ({cache.n_slots * cache.slot_bytes / 2**20:.0f}"
          f" MiB): decode read {read / tokens / 2**20:.1f} MiB a token from disk "
          f"({tokens / seconds:.2f} tok/s); over the run: hit rate {st.hit_rate:.0%}, "
          f"lookahead {st.lookahead_rate:.0%} of {st.prefetched} read ahead")
