"""fucina vs llama.cpp: the same GGUF, the same threads, one after the other.

    python bench/bench_vs_llama.py MODEL [MODEL ...] [--threads 2] [--pp 16,64,256]
        [--tg 128] [--repeats 3] [--rounds 1] [--levels avx512vnni,avx2,generic]
        [--llama-path DIR] [--llama-avx2 DIR] [--llama-bench PATH]
        [--llama-bench-avx2 PATH] [--markdown]

MODEL is a path, a named model (see `fucina models list`), or one of the synthetic specs
`synth:GEOMETRY:FORMAT[:layers=N][:skew=S]`, written into the cache dir on first use:
GEOMETRY is `qwen3-0.6b`, `qwen3-moe-1gb` (128 experts, 8 per token;
fucina_course/synth.py), `qwen3-30b-a3b`, or the 1 GB MoE's dense twins
`qwen3-moe-1gb-dense-active` / `-dense-total` (an FFN as wide as 8 / 128 experts), e.g.
`synth:qwen3-0.6b:Q4_K`, `synth:qwen3-moe-1gb:Q8_0`.  `layers=N` cuts the geometry to N
layers; `skew=S` gives a MoE balanced routers (0: tokens spread over the experts as a
trained router spreads them; S > 0: a Zipf-like popularity; fucina_course/synth_router.py).

Kernel levels (fucina_course/quant/isa.py): `--levels` runs fucina once per level
(FUCINA_SIMD=<level>; default: the best this CPU runs).  Below avx512vnni the whole
fucina process is made to run as on a CPU without AVX-512 (numba compiles for Haswell
or Alder Lake, OpenBLAS uses its Haswell kernels; `--no-emulate`: FUCINA_SIMD only).
Each level is compared with
the llama.cpp build of the same instruction set: `--llama-avx2 DIR` is a
llama-cpp-python built with AVX-512 off (scripts/build_llama_cpp_avx2.sh; default: its
default directory, ~/.cache/fucina_course/llama-avx2, if built), used for the levels
below avx512vnni; otherwise (and for avx512vnni) the environment's llama_cpp,
or `--llama-path DIR`.  The build's own `llama_print_system_info` is reported.  The
issue-10 table (docs/BENCHMARKS.md, kernel levels), on a quiet machine:

    scripts/build_llama_cpp_avx2.sh                       # once, ~15 min
    scripts/build_llama_bench.sh                          # once each, ~10-15 min:
    LLAMA_CPP_ISA=avx2 scripts/build_llama_bench.sh       #   the second witnesses
    python bench/bench_vs_llama.py synth:qwen3-0.6b:Q8_0 synth:qwen3-0.6b:Q4_K \\
        qwen2.5-coder-0.5b smollm2-135m --threads 2 --pp 64,256 --tg 64 \\
        --repeats 3 --levels avx512vnni,avx2,generic --markdown

Protocol (identical for both engines; see fucina_course/bench.py): warm-up, then for
each ppN a fresh context and one N-token evaluation, and tgN single-token evaluations
from position 0; median of `--repeats`.  llama.cpp runs through llama-cpp-python
(`Llama.eval`), f16 KV cache, n_batch 512, the same thread count; its per-call Python
overhead is ~0.1 ms, under 1% of a decode step here.  Each engine runs in its own
subprocess, sequentially, so neither disturbs the other's timing.

Second witness, llama.cpp's own C++ benchmark `llama-bench` (issue 27): built by
scripts/build_llama_bench.sh from the same vendored llama.cpp source as the binding and
with the same CMake flags (scripts/llama_cpp_flags.sh), found at `--llama-bench PATH`
(default: ~/.cache/fucina_course/llama-bench/bin/llama-bench; if there is no binary, its
columns are left out with a one-line note; `--llama-bench ""` leaves them out).  It runs
as `llama-bench -m FILE -p <pp list> -n <tg> -t <threads> -r <repeats> -o json -b 512
-ub 512 -ctk f16 -ctv f16 -fa off`: n_batch and n_ubatch 512 and flash attention off
because those are what the binding runs here (llama_cpp.Llama's defaults, the ones
above; llama-bench's own defaults are n_batch 2048 and flash attention "auto"; n_batch
only matters for prompts over 512 tokens, flash attention changes the attention kernels
at every size), f16 KV cache as both other engines.  Its protocol is its own: a warm-up
run of each test, then per repetition a cleared KV cache and the whole test (ppN: N
random tokens in one batch; tgN: N single-token decodes from position 0); the figure
taken is the median of its `samples_ts` (per-repetition tok/s, as our medians; its
`avg_ts` is their mean).  No Python between the calls: where the binding and llama-bench
disagree by more than 10% on a test, a warning line names it -- one of the two
measurements is then not the llama.cpp speed.  llama-bench is the build of the best ISA
(the environment's flags), so it is compared only with the levels that use the main
binding.  The levels run against `--llama-avx2` have their own second witness,
`--llama-bench-avx2 PATH` (default: ~/.cache/fucina_course/llama-bench-avx2/bin/
llama-bench, built by `LLAMA_CPP_ISA=avx2 scripts/build_llama_bench.sh`: the same
source, llama.cpp's AVX2 level as the AVX2 binding), in the same columns.

`--rounds N`: each fucina run is followed by a llama.cpp run of the matching build (and,
once per round, by llama-bench: fucina, binding, llama-bench, never two at once), N
times over; the table gives each engine's median over the rounds and the median of the
rounds' ratios.  On a shared virtual machine whose speed drifts by tens of percent
from one minute to the next (2026-12-01: llama.cpp's own AVX2 prefill measured 95 and
161 tok/s in two runs an hour apart), a ratio of two runs made back to back is the
figure that means something; with one round, llama.cpp is measured once per build and
model and every level is compared with that one run.

Steal time: on a virtual machine the hypervisor may give part of the CPU time to other
guests (Linux counts it as "steal" in /proc/stat).  Each run's share is measured, each
round's line shows the largest of its runs', the table's last column the largest over
the rounds, and a warning names the models where it passed 5%: such ratios compare
two engines that each got an unknown part of the machine.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import platform
import re
import statistics
import subprocess
import sys
import time

LEVELS = ("avx512vnni", "avxvnni", "avx2", "generic")
_V3 = "+sse4.2,+ssse3,+popcnt,+avx,+avx2,+fma,+f16c,+bmi,+bmi2,+lzcnt,+movbe,+cx16"
# --emulate: what a CPU without AVX-512 runs, for the whole process -- numba compiles
# every kernel (attention, norms, the generic level) for it and OpenBLAS uses its
# Haswell kernels, not only the quant kernels of the level
EMULATE = {
    "avxvnni": {"NUMBA_CPU_NAME": "alderlake", "NUMBA_CPU_FEATURES": _V3 + ",+avxvnni",
                "OPENBLAS_CORETYPE": "Haswell"},
    "avx2": {"NUMBA_CPU_NAME": "haswell", "NUMBA_CPU_FEATURES": _V3,
             "OPENBLAS_CORETYPE": "Haswell"},
    "generic": {"NUMBA_CPU_NAME": "haswell", "NUMBA_CPU_FEATURES": _V3,
                "OPENBLAS_CORETYPE": "Haswell"},
}


def resolve(model: str) -> str:
    if model.startswith("synth:"):
        from fucina_course.synth import (QWEN3_0_6B, QWEN3_30B_A3B, QWEN3_MOE_1GB,
                                         cached_synthetic, dense_twin, with_format,
                                         with_layers)

        moe = QWEN3_MOE_1GB
        geometries = {"qwen3-0.6b": QWEN3_0_6B, "qwen3-moe-1gb": moe,
                      "qwen3-30b-a3b": QWEN3_30B_A3B,
                      # the MoE's dense twins: as many parameters per token / in total
                      "qwen3-moe-1gb-dense-active": dense_twin(moe, moe.num_experts_used),
                      "qwen3-moe-1gb-dense-total": dense_twin(moe, moe.num_experts)}
        _, geometry, fmt, *options = model.split(":")
        if geometry not in geometries:
            raise SystemExit(f"unknown synthetic geometry {geometry!r} "
                             f"(known: {', '.join(geometries)})")
        spec = with_format(geometries[geometry], fmt)
        skew = None
        for option in options:                  # layers=N, skew=S
            key, _, value = option.partition("=")
            if key == "layers" and value.isdigit():
                spec = with_layers(spec, int(value))
            elif key == "skew" and re.fullmatch(r"\d+(\.\d+)?", value):
                skew = float(value)
            else:
                raise SystemExit(f"unknown synthetic option {option!r} "
                                 "(layers=N or skew=S)")
        if skew is not None:                    # balanced routers (synth_router.py)
            from fucina_course.synth_router import routed_synthetic

            return str(routed_synthetic(spec, skew))
        return str(cached_synthetic(spec))
    from fucina_course.catalog import resolve as resolve_model

    return str(resolve_model(model))


def llama_bench(path: str, threads: int, pp: list[int], tg: int, repeats: int) -> dict:
    """Runs inside a subprocess (see main): llama.cpp's numbers under our protocol."""
    import llama_cpp
    import numpy as np

    n_ctx = max(pp + [tg]) + 16
    llm = llama_cpp.Llama(path, n_ctx=n_ctx, n_batch=512, n_ubatch=512,
                          n_threads=threads, n_threads_batch=threads, verbose=False)
    vocab = min(llm.n_vocab(), 100_000)

    def ids(n, seed):
        return np.random.default_rng(seed).integers(0, vocab, size=n).tolist()

    def timed_prefill(n):
        toks = ids(n, n)
        out = []
        for _ in range(repeats):
            llm.reset()
            if hasattr(llm._ctx, "kv_cache_clear"):
                llm._ctx.kv_cache_clear()
            t = time.perf_counter()
            llm.eval(toks)
            out.append(time.perf_counter() - t)
        return statistics.median(out)

    def timed_decode(n):
        toks = ids(n, 7)
        out = []
        for _ in range(repeats):
            llm.reset()
            t = time.perf_counter()
            for tok in toks:
                llm.eval([tok])
            out.append(time.perf_counter() - t)
        return statistics.median(out)

    timed_prefill(min(16, max(pp or [16])))  # warm-up
    llm.reset()
    for tok in ids(4, 1):
        llm.eval([tok])
    info = llama_cpp.llama_print_system_info().decode(errors="replace")
    on = {f.split("=")[0].strip() for f in info.split("|") if f.strip().endswith("= 1")}
    best = [f for f in ("AVX512_VNNI", "AVX512", "AVX_VNNI", "AVX2", "AVX") if f in on]
    result = {"model": path, "threads": threads, "prefill": [],
              "build": os.path.dirname(os.path.dirname(llama_cpp.__file__)),
              "isa": best[0] if best else "no AVX"}
    for n in pp:
        result["prefill"].append({"tokens": n, "tok_s": n / timed_prefill(n)})
    if tg:
        result["decode"] = {"tokens": tg, "tok_s": tg / timed_decode(tg)}
    return result


def run_sub(args: list[str], threads: int, env_extra: dict | None = None) -> dict:
    env = dict(os.environ, OPENBLAS_NUM_THREADS=str(threads),
               OMP_NUM_THREADS=str(threads), **(env_extra or {}))
    out = subprocess.run([sys.executable, *args], capture_output=True, text=True,
                         env=env)
    if out.returncode != 0:
        raise SystemExit(f"benchmark subprocess failed: {' '.join(args)}\n"
                         f"{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def cpu_times() -> tuple[int, int] | None:
    """(steal, total) clock ticks of all CPUs so far (/proc/stat), or None where there
    is no such file."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    # user nice system idle iowait irq softirq steal (guest time is inside user)
    ticks = [int(v) for v in fields[1:9]]
    return (ticks[7] if len(ticks) > 7 else 0), sum(ticks)


def steal_share(before, after) -> float | None:
    """The share of the machine's CPU time the hypervisor gave to other guests between
    two `cpu_times()`: 0 on a quiet host.  On 2026-12-03 a VM of ours ran with 35-50%
    stolen, and both engines at half their speed of the day before, unevenly: a
    ratio from such a round says more about the neighbours than about the engines."""
    if before is None or after is None or after[1] <= before[1]:
        return None
    return (after[0] - before[0]) / (after[1] - before[1])


def timed_steal(fn, *args):
    """fn(*args) and the steal share while it ran."""
    t0 = cpu_times()
    out = fn(*args)
    return out, steal_share(t0, cpu_times())


DEFAULT_LLAMA_BENCH = os.path.expanduser(
    "~/.cache/fucina_course/llama-bench/bin/llama-bench")
DEFAULT_LLAMA_BENCH_AVX2 = os.path.expanduser(
    "~/.cache/fucina_course/llama-bench-avx2/bin/llama-bench")
# scripts/build_llama_cpp_avx2.sh's default: the AVX2 binding, kept beside the models
DEFAULT_LLAMA_AVX2 = os.path.expanduser("~/.cache/fucina_course/llama-avx2")
DISAGREE = 0.10   # binding vs llama-bench: warn above this relative difference
STOLEN = 0.05     # warn when a round had more of the CPU time stolen than this


def llama_bench_cmd(exe: str, path: str, threads: int, pp: str, tg: int,
                    repeats: int) -> list[str]:
    """llama-bench's command line for our tests (see the module docstring for the
    choice of n_batch, n_ubatch, flash attention and KV cache type)."""
    pp_list = ",".join(x for x in pp.split(",") if x.strip()) or "0"
    return [exe, "-m", path, "-p", pp_list, "-n", str(tg), "-t", str(threads),
            "-r", str(repeats), "-o", "json", "-b", "512", "-ub", "512",
            "-ctk", "f16", "-ctv", "f16", "-fa", "off"]


def parse_llama_bench(text: str) -> dict:
    """llama-bench's `-o json` output -> {"pp64": tok/s, "tg16": tok/s, ...,
    "build": "commit C build N"}: per test the median of its per-repetition tok/s
    (`samples_ts`), its `avg_ts` if there are none."""
    out: dict = {}
    for t in json.loads(text):
        samples = t.get("samples_ts") or [t["avg_ts"]]
        if t.get("n_prompt", 0) > 0 and t.get("n_gen", 0) == 0:
            test = f"pp{t['n_prompt']}"
        elif t.get("n_gen", 0) > 0 and t.get("n_prompt", 0) == 0:
            test = f"tg{t['n_gen']}"
        else:
            continue
        out[test] = float(statistics.median(samples))
        out["build"] = (f"commit {t.get('build_commit', '?')} "
                        f"build {t.get('build_number', '?')}")
    return out


def run_llama_bench(exe: str, path: str, threads: int, pp: str, tg: int,
                    repeats: int) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    out = subprocess.run(llama_bench_cmd(exe, path, threads, pp, tg, repeats),
                         capture_output=True, text=True, env=env)
    if out.returncode != 0:     # the witness failing costs its column, not the run
        print(f"warning: llama-bench failed on {path} ({exe}), its column is left "
              f"out:\n{out.stderr[-2000:]}", file=sys.stderr)
        return {}
    return parse_llama_bench(out.stdout)


def usable_llama_bench(given: str | None, default: str, how: str) -> str:
    """The llama-bench binary to run (`given`, or `default` if None), or "" with a
    note on stderr if there is none: the witness missing costs its column only."""
    exe = default if given is None else given
    if exe and not (os.path.isfile(exe) and os.access(exe, os.X_OK)):
        print(f"note: no llama-bench at {exe} ({how}scripts/build_llama_bench.sh builds "
              "it): its column is left out", file=sys.stderr)
        return ""
    if not exe:
        print("note: a llama-bench of \"\": its column is left out", file=sys.stderr)
    return exe


def avx2_binding(given: str | None, levels: list[str]) -> str | None:
    """The AVX2 llama-cpp-python for the levels below avx512vnni: `given`, or
    DEFAULT_LLAMA_AVX2 if None and it holds a llama_cpp, else None (those levels are
    then compared with the main binding, with a note).  "" means none."""
    if not any(lv and lv != "avx512vnni" for lv in levels):
        return None
    if given is None and os.path.isdir(os.path.join(DEFAULT_LLAMA_AVX2, "llama_cpp")):
        given = DEFAULT_LLAMA_AVX2
    if not given:
        print("note: no AVX2 llama-cpp-python (scripts/build_llama_cpp_avx2.sh builds "
              f"it into {DEFAULT_LLAMA_AVX2}): the levels below avx512vnni are compared "
              "with the main binding", file=sys.stderr)
        return None
    return given


def disagreement(binding: float, bench: float) -> float:
    """Relative difference of the binding's tok/s from llama-bench's."""
    return binding / bench - 1.0


def llama_env(build: str | None) -> dict:
    """The environment that makes `import llama_cpp` load `build` (None: the
    environment's own)."""
    if not build:
        return {}
    return {"PYTHONPATH": os.pathsep.join(
        [os.path.abspath(build), os.environ.get("PYTHONPATH", "")])}


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # "writing synthetic..."
    ap = argparse.ArgumentParser()
    ap.add_argument("models", nargs="+")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--pp", default="16,64,256")
    ap.add_argument("--tg", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=1,
                    help="fucina / llama.cpp pairs per level, run back to back; medians "
                         "over the rounds (see the module docstring)")
    ap.add_argument("--levels", default="",
                    help="fucina kernel levels, comma-separated (FUCINA_SIMD; "
                         "default: the best this CPU runs)")
    ap.add_argument("--llama-path", default=None,
                    help="directory holding the llama_cpp package to compare with")
    ap.add_argument("--llama-avx2", default=None,
                    help="llama_cpp built with AVX-512 off, for the levels below "
                         f"avx512vnni (default: {DEFAULT_LLAMA_AVX2}, if built; "
                         "\"\": none)")
    ap.add_argument("--llama-bench", default=None, metavar="PATH",
                    help="llama.cpp's llama-bench binary, the second llama.cpp column "
                         "(default: scripts/build_llama_bench.sh's, "
                         f"{DEFAULT_LLAMA_BENCH}, if built; \"\": none)")
    ap.add_argument("--llama-bench-avx2", default=None, metavar="PATH",
                    help="llama-bench built for llama.cpp's AVX2 level, the second "
                         "witness of the levels run against --llama-avx2 (default: "
                         f"{DEFAULT_LLAMA_BENCH_AVX2}, if built; \"\": none)")
    ap.add_argument("--no-emulate", dest="emulate", action="store_false",
                    help="levels below avx512vnni: only FUCINA_SIMD, with numba and "
                         "OpenBLAS still using this CPU's AVX-512 elsewhere")
    ap.add_argument("--markdown", action="store_true",
                    help="print a docs/BENCHMARKS.md table")
    ap.add_argument("--llama-worker", nargs=5, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.llama_worker:
        path, threads, pp, tg, repeats = args.llama_worker
        print(json.dumps(llama_bench(path, int(threads),
                                     [int(x) for x in pp.split(",") if x],
                                     int(tg), int(repeats))))
        return

    levels = [lv.strip() for lv in args.levels.split(",") if lv.strip()] or [""]
    bad = [lv for lv in levels if lv and lv not in LEVELS]
    if bad:
        raise SystemExit(f"unknown level(s) {bad}: expected some of {LEVELS}")
    args.llama_avx2 = avx2_binding(args.llama_avx2, levels)
    # the witness of each llama.cpp build: {build dir or None: llama-bench path or ""}
    lb_exes = {args.llama_path: usable_llama_bench(args.llama_bench,
                                                   DEFAULT_LLAMA_BENCH, "")}
    if args.llama_avx2 and any(lv and lv != "avx512vnni" for lv in levels):
        lb_exes[args.llama_avx2] = usable_llama_bench(
            args.llama_bench_avx2, DEFAULT_LLAMA_BENCH_AVX2, "LLAMA_CPP_ISA=avx2 ")
    rows, builds, lb_builds, warnings, warned = [], {}, set(), [], set()
    for model in args.models:
        path = resolve(model)
        print(f"== {model}: {path}", file=sys.stderr)
        theirs_by_build: dict = {}
        # (level, isa, test) -> [(fucina tok/s, llama.cpp tok/s, llama-bench tok/s or
        # None)], one triple per round
        runs: dict = {}
        lbs: dict = {}          # build -> llama-bench's last figures
        for rnd in range(args.rounds):
            lb_this_round: set = set()
            for level in levels:
                build = args.llama_path
                if level and level != "avx512vnni" and args.llama_avx2:
                    build = args.llama_avx2
                env = {"FUCINA_SIMD": level} if level else {}
                if args.emulate:
                    env.update(EMULATE.get(level, {}))
                ours, st = timed_steal(
                    run_sub, ["-m", "fucina_course", "bench", path, "--threads",
                              str(args.threads), "--pp", args.pp, "--tg", str(args.tg),
                              "--repeats", str(args.repeats), "--json"],
                    args.threads, env)
                steals = [st]       # this round's runs: fucina, binding, llama-bench
                # rounds: llama.cpp again right after each fucina run
                if build not in theirs_by_build or args.rounds > 1:
                    theirs_by_build[build], st = timed_steal(
                        run_sub, [__file__, "x", "--llama-worker", path,
                                  str(args.threads), args.pp, str(args.tg),
                                  str(args.repeats)], args.threads, llama_env(build))
                    steals.append(st)
                theirs = theirs_by_build[build]
                builds[theirs["build"]] = theirs["isa"]
                # llama-bench, the build's witness: once a round, after the binding
                exe = lb_exes.get(build, "")
                if exe and build not in lb_this_round and (build not in lbs
                                                           or args.rounds > 1):
                    lbs[build], st = timed_steal(run_llama_bench, exe, path,
                                                 args.threads, args.pp, args.tg,
                                                 args.repeats)
                    steals.append(st)
                    if "build" in lbs[build]:
                        lb_builds.add(f"{exe}: {lbs[build]['build']}")
                    lb_this_round.add(build)
                lb = lbs.get(build)
                label = level or "default"
                pairs = [(f"pp{a['tokens']}", a["tok_s"], b["tok_s"])
                         for a, b in zip(ours["prefill"], theirs["prefill"])]
                if "decode" in ours:
                    pairs.append((f"tg{ours['decode']['tokens']}",
                                  ours["decode"]["tok_s"], theirs["decode"]["tok_s"]))
                stolen = max((x for x in steals if x is not None), default=None)
                for test, a, b in pairs:
                    c = lb.get(test) if lb else None
                    runs.setdefault((label, theirs["isa"], test), []).append(
                        (a, b, c, stolen))
                    print(f"  {label:>10} {test:>6}: fucina {a:9.1f} tok/s   llama.cpp "
                          f"({theirs['isa']}) {b:9.1f} tok/s   ratio {a / b:.2f}"
                          + (f"   llama-bench {c:9.1f} tok/s   ratio {a / c:.2f}"
                             if c else "")
                          + (f"   steal {100 * stolen:.0f}%" if stolen is not None
                             else "")
                          + (f"   (round {rnd + 1})" if args.rounds > 1 else ""),
                          file=sys.stderr)
        for (label, isa, test), got in runs.items():
            cs = [c for _, _, c, _ in got if c]
            c_med = statistics.median(cs) if len(cs) == len(got) else None
            b_med = statistics.median(b for _, b, _, _ in got)
            sts = [x for *_, x in got if x is not None]
            most_stolen = max(sts) if sts else None
            rows.append((model, label, isa, test,
                         statistics.median(a for a, _, _, _ in got), b_med,
                         statistics.median(a / b for a, b, _, _ in got),
                         [a / b for a, b, _, _ in got], c_med,
                         statistics.median(a / c for a, _, c, _ in got) if c_med
                         else None, most_stolen))
            if most_stolen is not None and most_stolen > STOLEN \
                    and (model, "steal") not in warned:
                warned.add((model, "steal"))
                warnings.append(
                    f"warning: {model}: the hypervisor took up to "
                    f"{100 * most_stolen:.0f}% of the CPU time in a round (more than "
                    f"{100 * STOLEN:.0f}%): its ratios measure the neighbours too")
            seen = (model, test, round(b_med, 1), round(c_med or 0, 1))
            if (c_med and abs(disagreement(b_med, c_med)) > DISAGREE
                    and seen not in warned):
                warned.add(seen)    # one round: the levels share the llama.cpp runs
                warnings.append(
                    f"warning: {model} {label} {test}: llama-cpp-python {b_med:.1f} and "
                    f"llama-bench {c_med:.1f} tok/s disagree by "
                    f"{100 * disagreement(b_med, c_med):+.0f}% (more than "
                    f"{100 * DISAGREE:.0f}%)")
    for line in warnings:
        print(line, file=sys.stderr)
    with_lb = any(r[8] for r in rows)
    if args.markdown:
        from fucina_course.quant.isa import cpu_family, cpu_name

        cpu = f"{cpu_name()} ({cpu_family()})"
        emu = ("levels below avx512vnni emulate a CPU without AVX-512 (numba, "
               "OpenBLAS)" if args.emulate else "FUCINA_SIMD only")
        rounds = (f"; {args.rounds} rounds (each fucina run followed by llama.cpp's): "
                  "medians over the rounds, ratio = the median of the rounds' ratios"
                  if args.rounds > 1 else "")
        print(f"\n{datetime.date.today()} — {cpu}, {os.cpu_count()} cores, "
              f"threads={args.threads}, Python {platform.python_version()}, median of "
              f"{args.repeats}{rounds}; {emu}; llama.cpp builds: "
              + "; ".join(f"{b} ({isa})" for b, isa in builds.items())
              + (f"; llama-bench: {'; '.join(sorted(lb_builds))} (same source and "
                 "flags as the binding of its ISA)" if with_lb else "")
              + "\n")
        each = " | rounds" if args.rounds > 1 else ""
        lb_head = " llama-bench tok/s | ratio (llama-bench) |" if with_lb else ""
        with_steal = any(r[10] is not None for r in rows)
        print("| model | fucina level | llama.cpp ISA | test | fucina tok/s | "
              f"llama.cpp tok/s | ratio{each} |{lb_head}"
              + (" steal (max) |" if with_steal else ""))
        print("|---|---|---|---|---:|---:|---:|" + ("---|" if each else "")
              + ("---:|---:|" if with_lb else "") + ("---:|" if with_steal else ""))
        for (model, level, isa, test, a, b, ratio, per_round, c, ratio_c,
             stolen) in rows:
            extra = (" | " + " ".join(f"{r:.2f}" for r in per_round)) if each else ""
            lb_cells = ((f" {c:.1f} | {ratio_c:.2f} |" if c else " – | – |")
                        if with_lb else "")
            st_cell = ((f" {100 * stolen:.0f}% |" if stolen is not None else " – |")
                       if with_steal else "")
            print(f"| {model} | {level} | {isa} | {test} | {a:.1f} | {b:.1f} | "
                  f"{ratio:.2f}{extra} |{lb_cells}{st_cell}")
        if warnings:        # under the table too: they say which rows not to trust
            print("\n" + "\n".join(warnings))


if __name__ == "__main__":
    main()
