"""A MoE model bigger than the memory limit: fucina's expert cache against llama.cpp's
memory map, in one run, on one file (issue 46).

    sudo python bench/bench_expert_stream.py [--layers 18] [--limit 2G] [--tokens 16]
        [--skew 0 | --raw-router]

The file: the synthetic Qwen3-30B-A3B geometry in Q4_K with `--layers` layers
(`synth:qwen3-30b-a3b:Q4_K:layers=N:skew=S`, ~350 MB a layer), whose tokens spread over
the experts as a trained router's do (fucina_course/synth_router.py; `--raw-router`: the
plain synthetic file, whose tokens keep to a few experts and flatter the cache).  Each
run below starts cold (the page cache dropped) inside a cgroup memory limit that counts
the page cache (scripts/in_memory_limit.py):

1. how far the routing is from uniform: the share of a prefill's routes the 20% most
   used experts take (a uniform router: ~26% for 128 tokens; 24.8% on the one published
   trace of a real Qwen3 MoE, synth_router.py);
2. the disk's cold read bandwidth, twice: a sequential sweep of the file (8 MiB reads),
   and random experts read through an ExpertCache as a decode step reads its misses,
   once before and once after fucina's run (this VM's disk has given 1.79 and 0.62
   GB/s minutes apart: the bound uses the figures taken around the run);
3. fucina, unlimited: the greedy ids of `--tokens` tokens (the reference);
4. fucina in the limit: the same ids (they must be equal), then decode tokens/s and the
   bytes read from disk per token (`fucina bench`, which picks the expert cache by
   itself from the limit);
5. llama.cpp in the limit, decoding the same number of tokens with the same threads and
   mmap on: the binding (llama-cpp-python) as it loads by default (its CPU "repack"
   copies Q4_K weights into anonymous memory: in a limit smaller than the file it is
   killed) and with `use_extra_bufts` off, the weights left in the map (paged in and
   out by the kernel); and llama-bench (scripts/build_llama_bench.sh), if it is built.

The I/O bound is the expert read bandwidth over the bytes read per token: no cache
policy decodes faster than that on this disk with this cache size (the compute is
hidden behind the reads at best).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LIMIT = [sys.executable, str(ROOT / "scripts" / "in_memory_limit.py")]
PY = sys.executable
# llama-bench's loads, as the binding's: the weights left in the map (`--repack 0`), and
# as it loads by default (mmap on, CPU repack)
LLAMA_BENCH_LOADS: tuple[tuple[str, list[str]], ...] = (
    ("off", ["-lm", "mmap", "--repack", "0"]), ("on", ["-lm", "mmap"]))

LLAMA = r"""
import sys, time
import llama_cpp
path, threads, n, repack = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
if repack == "off":              # no CPU repack buffers: the weights stay in the map
    low = llama_cpp.llama_cpp
    default = low.llama_model_default_params

    def params():
        p = default()
        p.use_extra_bufts = False
        return p

    low.llama_model_default_params = params
llm = llama_cpp.Llama(path, n_ctx=64, n_threads=threads, n_threads_batch=threads,
                      use_mmap=True, verbose=False)
llm.eval([1000, 1001, 1002, 1003])
t0 = time.perf_counter()
for i in range(n):
    llm.eval([2000 + i])
print(f"LLAMA {n / (time.perf_counter() - t0):.3f}")
"""


def cold_read_bandwidth(path: str) -> float:
    """GB/s reading the file once, cold, 8 MiB at a time."""
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")
    buf = bytearray(8 << 20)
    t0, total = time.perf_counter(), 0
    with open(path, "rb", buffering=0) as f:
        while (n := f.readinto(buf)):
            total += n
    return total / (time.perf_counter() - t0) / 1e9


def top_fifth_share(path: str, tokens: int = 128) -> float:
    """The share of a prefill's routes (random ids) taken by the 20% most used experts,
    averaged over the layers: how far the file's routing is from uniform."""
    import numpy as np

    from fucina_course import moe
    from fucina_course.model import Model

    model = Model.load(path)
    ids = np.random.default_rng(7).integers(1000, 100_000, tokens).tolist()
    with moe.recording(model) as log:
        model.forward_all_logits(ids)
    return log.top_share(0.2)


def expert_read_bandwidth(path: str, experts: int = 384, seed: int = 0) -> float:
    """GB/s reading `experts` random experts cold through an `ExpertCache`, k at a time
    in one layer (a decode step's misses): the threads, read sizes and offsets of the
    run itself, not a sequential sweep (the VM's disk gave 1.79 GB/s sequentially in
    one run and 0.62 GB/s in the next, 2026-12-05, and the decode run beat the bound
    computed from the sequential figure)."""
    import numpy as np

    from fucina_course.expert_cache import ExpertCache, expert_ranges
    from fucina_course.model import Model
    from fucina_course.moe import MoeFfn

    model = Model.load(path)
    moe = {i: layer.ffn for i, layer in enumerate(model.layers)
           if isinstance(layer.ffn, MoeFfn)}
    first = next(iter(moe.values()))
    k, n_experts = first.k, len(first.experts)
    cache = ExpertCache(path, expert_ranges(model.gguf, moe),
                        (experts + k) * first.expert_nbytes)
    rng = np.random.default_rng(seed)
    steps = [(int(rng.choice(list(moe))), rng.choice(n_experts, k, replace=False))
             for _ in range(experts // k)]
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")
    t0 = time.perf_counter()
    for layer, chosen in steps:
        cache.acquire(layer, chosen)
        cache.release()
    seconds = time.perf_counter() - t0
    cache.close()
    return cache.stats.bytes_read / seconds / 1e9


def run(cmd: list, limit: str | None) -> subprocess.CompletedProcess:
    full = (LIMIT + [limit, "--drop-caches", "--"] + cmd) if limit else cmd
    r = subprocess.run(full, capture_output=True, text=True)
    sys.stderr.write(r.stderr[-2000:])
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=18)
    ap.add_argument("--limit", default="2G")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--skew", type=float, default=0.0,
                    help="router skew of the synthetic file (fucina_course/"
                         "synth_router.py; 0: spread as a trained router)")
    ap.add_argument("--raw-router", action="store_true",
                    help="the plain synthetic file, whose tokens keep to few experts")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT / "bench"))
    from bench_vs_llama import resolve

    name = f"synth:qwen3-30b-a3b:Q4_K:layers={args.layers}"
    path = resolve(name if args.raw_router else f"{name}:skew={args.skew:g}")
    size = os.path.getsize(path)
    print(f"{path}: {size / 2**30:.2f} GiB; limit {args.limit}; {args.threads} threads",
          flush=True)
    share = top_fifth_share(path)
    sequential = cold_read_bandwidth(path)
    gen = [PY, "-m", "fucina_course", "generate", path, "--ids", "1000,1001,1002,1003",
           "--gen", str(args.tokens), "--ignore-eos", "--threads", str(args.threads)]
    ref, out = Path("/tmp/fucina-ref.ids"), Path("/tmp/fucina-limited.ids")
    assert run(gen + ["--ids-out", str(ref)], None).returncode == 0
    limited = run(gen + ["--ids-out", str(out)], args.limit)
    same = limited.returncode == 0 and out.read_text() == ref.read_text()
    before = expert_read_bandwidth(path, seed=1)
    bench = run([PY, "-m", "fucina_course", "bench", path, "--pp", "", "--tg",
                 str(args.tokens), "--repeats", "1", "--threads", str(args.threads)],
                args.limit)
    after = expert_read_bandwidth(path, seed=2)
    bandwidth = (before + after) / 2
    m = re.search(r"decode read ([\d.]+) MiB a token from disk \(([\d.]+) tok/s\)",
                  bench.stdout)
    mib, fucina = (float(m.group(1)), float(m.group(2))) if m else (float("nan"),) * 2
    theirs = {}
    for repack in ("on", "off"):
        llama = run([PY, "-c", LLAMA, path, str(args.threads), str(args.tokens), repack],
                    args.limit)
        m = re.search(r"LLAMA ([\d.]+)", llama.stdout)
        theirs[repack] = float(m.group(1)) if m else \
            f"status {llama.returncode}" + (" (OOM)" if llama.returncode == 137 else "")
    from bench_vs_llama import (DEFAULT_LLAMA_BENCH, llama_bench_cmd,
                                parse_llama_bench)
    if os.access(DEFAULT_LLAMA_BENCH, os.X_OK):
        for repack, extra in LLAMA_BENCH_LOADS:
            r = run(llama_bench_cmd(DEFAULT_LLAMA_BENCH, path, args.threads, "",
                                    args.tokens, 1) + extra, args.limit)
            got = parse_llama_bench(r.stdout).get(f"tg{args.tokens}") \
                if r.returncode == 0 else None
            theirs[f"bench-{repack}"] = got if got is not None else \
                f"status {r.returncode}" + (" (OOM)" if r.returncode == 137 else "")
    bound = bandwidth * 1e9 / (mib * 2**20)
    print(bench.stdout)
    print(f"routing: the top 20% of experts take {share:.0%} of a prefill's routes "
          "(mean over layers; uniform: ~26% for 128 tokens)")
    print(f"cold read: {sequential:.2f} GB/s sequentially, {before:.2f} / {after:.2f} "
          f"GB/s reading experts as the cache does (before / after fucina's run); "
          f"greedy ids in the limit equal the unlimited run's: {same}")
    print("| decode, in the limit | tok/s | vs llama.cpp | of the I/O bound |")
    print("|---|---:|---:|---:|")
    print(f"| fucina, expert cache ({mib:.0f} MiB read a token) | {fucina:.2f} | "
          f"| {fucina / bound:.0%} of {bound:.2f} |")
    for key, label in (("off", "binding, mmap, no repack"),
                       ("on", "binding, default: mmap + repack"),
                       ("bench-off", "llama-bench, mmap, no repack"),
                       ("bench-on", "llama-bench, default: mmap + repack")):
        if key in theirs:
            value = theirs[key]
            if isinstance(value, float):
                print(f"| llama.cpp ({label}) | {value:.2f} | fucina "
                      f"{fucina / value:.1f}x | |")
            else:
                print(f"| llama.cpp ({label}) | {value} | | |")


if __name__ == "__main__":
    main()
