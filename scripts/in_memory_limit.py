"""Run a command inside a memory limit that counts the page cache, as a small machine
would: the case of issue 46 (a MoE model bigger than the memory), reproducible on a
machine with plenty of RAM, for fucina and llama.cpp alike.

    sudo python scripts/in_memory_limit.py 2G [--drop-caches] -- COMMAND [ARGS...]

A cgroup of its own (v1 `memory.limit_in_bytes`, or v2 `memory.max`) is made under the
memory controller, the command is started inside it, and removed after; the command's
exit status is this script's.  On the way out it prints (stderr) the peak usage the
cgroup saw and whether the kernel's OOM killer fired.  `--drop-caches` first writes
3 to /proc/sys/vm/drop_caches, so the run starts cold (the file's pages are not
already in memory, charged to nobody).  Needs root and a writable cgroup hierarchy.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

V1 = Path("/sys/fs/cgroup/memory")
V2 = Path("/sys/fs/cgroup")


def make_cgroup(limit: int) -> tuple[Path, str]:
    """A new cgroup limited to `limit` bytes (page cache included): (its dir, version)."""
    name = f"fucina-limit-{os.getpid()}"
    if (V1 / "memory.limit_in_bytes").exists():
        cg = V1 / name
        cg.mkdir()
        (cg / "memory.limit_in_bytes").write_text(str(limit))
        try:                                   # no swap either, where it is accounted
            (cg / "memory.memsw.limit_in_bytes").write_text(str(limit))
        except OSError:
            pass
        return cg, "v1"
    if (V2 / "cgroup.controllers").exists():
        cg = V2 / name
        cg.mkdir()
        (cg / "memory.max").write_text(str(limit))
        (cg / "memory.swap.max").write_text("0")
        return cg, "v2"
    raise SystemExit("no cgroup memory controller found (v1 or v2)")


def report(cg: Path, version: str) -> str:
    if version == "v1":
        peak = int((cg / "memory.max_usage_in_bytes").read_text())
        oom = (cg / "memory.oom_control").read_text()
        killed = next((int(line.split()[1]) for line in oom.splitlines()
                       if line.startswith("oom_kill ")), 0)
    else:
        peak_file = cg / "memory.peak"
        peak = int(peak_file.read_text()) if peak_file.exists() else -1
        events = dict(line.split() for line in (cg / "memory.events").read_text()
                      .splitlines())
        killed = int(events.get("oom_kill", 0))
    return f"peak {peak / 2**30:.2f} GiB, OOM kills {killed}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("limit", help="e.g. 2G, 1800M")
    ap.add_argument("--drop-caches", action="store_true")
    argv = sys.argv[1:]
    if "--" not in argv:
        ap.error("give the command after --")
    cut = argv.index("--")
    args, command = ap.parse_args(argv[:cut]), argv[cut + 1:]
    if not command:
        ap.error("give the command after --")
    from fucina_course.expert_cache import parse_size

    limit = parse_size(args.limit)
    if args.drop_caches:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    cg, version = make_cgroup(limit)
    try:
        t0 = time.perf_counter()
        proc = subprocess.run(command, preexec_fn=lambda: (cg / "cgroup.procs")
                              .write_text(str(os.getpid())))
        print(f"[in_memory_limit] {args.limit} ({version}): {report(cg, version)}, "
              f"{time.perf_counter() - t0:.1f} s, status {proc.returncode}",
              file=sys.stderr)
        code = proc.returncode
        return 128 - code if code < 0 else code        # killed by a signal: 128 + N
    finally:
        for _ in range(50):                    # the last process may take a moment
            try:
                cg.rmdir()
                break
            except OSError:
                time.sleep(0.1)


if __name__ == "__main__":
    sys.exit(main())
