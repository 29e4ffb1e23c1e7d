"""A MoE model bigger than the memory limit: fucina's expert cache against llama.cpp's
memory map, in one run, on one file (issue 46).

    sudo python bench/bench_expert_stream.py [--layers 18] [--limit 2G] [--tokens 16]

The file: the synthetic Qwen3-30B-A3B geometry in Q4_K with `--layers` layers
(`synth:qwen3-30b-a3b:Q4_K:layers=N`, ~350 MB a layer).  Each run below starts cold
(the page cache dropped) inside a cgroup memory limit that counts the page cache
(scripts/in_memory_limit.py):

1. the cold read bandwidth of the disk, reading the file with 8 MiB reads;
2. fucina, unlimited: the greedy ids of `--tokens` tokens (the reference);
3. fucina in the limit: the same ids (they must be equal), then decode tokens/s and the
   bytes read from disk per token (`fucina bench`, which picks the expert cache by
   itself from the limit);
4. llama.cpp (llama-cpp-python, mmap on, the same threads) in the limit: decode
   tokens/s over the same number of tokens, as it loads by default (its CPU "repack"
   copies Q4_K weights into anonymous memory: in a limit smaller than the file it is
   killed) and with `use_extra_bufts` off, the weights left in the map (paged in and
   out by the kernel).

The I/O bound is the read bandwidth over the bytes read per token: no cache policy can
decode faster than that on this disk with this cache size.
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
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT / "bench"))
    from bench_vs_llama import resolve

    path = resolve(f"synth:qwen3-30b-a3b:Q4_K:layers={args.layers}")
    size = os.path.getsize(path)
    print(f"{path}: {size / 2**30:.2f} GiB; limit {args.limit}; {args.threads} threads",
          flush=True)
    bandwidth = cold_read_bandwidth(path)
    gen = [PY, "-m", "fucina_course", "generate", path, "--ids", "1000,1001,1002,1003",
           "--gen", str(args.tokens), "--ignore-eos", "--threads", str(args.threads)]
    ref, out = Path("/tmp/fucina-ref.ids"), Path("/tmp/fucina-limited.ids")
    assert run(gen + ["--ids-out", str(ref)], None).returncode == 0
    limited = run(gen + ["--ids-out", str(out)], args.limit)
    same = limited.returncode == 0 and out.read_text() == ref.read_text()
    bench = run([PY, "-m", "fucina_course", "bench", path, "--pp", "", "--tg",
                 str(args.tokens), "--repeats", "1", "--threads", str(args.threads)],
                args.limit)
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
    bound = bandwidth * 1e9 / (mib * 2**20)
    print(bench.stdout)
    print(f"cold read: {bandwidth:.2f} GB/s; greedy ids in the limit equal the "
          f"unlimited run's: {same}")
    print("| decode, in the limit | tok/s | vs llama.cpp | of the I/O bound |")
    print("|---|---:|---:|---:|")
    mapped = theirs["off"]
    ratio = f"{fucina / mapped:.1f}x" if isinstance(mapped, float) else "-"
    print(f"| fucina, expert cache ({mib:.0f} MiB read a token) | {fucina:.2f} | "
          f"{ratio} | {fucina / bound:.0%} of {bound:.2f} |")
    for repack, label in (("off", "mmap, no repack"), ("on", "default: mmap + repack")):
        value = theirs[repack]
        shown = f"{value:.2f}" if isinstance(value, float) else value
        print(f"| llama.cpp (binding, {label}) | {shown} | | |")


if __name__ == "__main__":
    main()
