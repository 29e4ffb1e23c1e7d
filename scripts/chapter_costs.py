"""Measure what each chapter costs to run, and write the tables of book/setup.md.

The setup page tells a reader how much memory, disk and time the book takes before they start;
those numbers must be measured, not typed, and the page has no code of its own to measure them
(running every chapter inside it would double the build). So this script runs each chapter from
top to bottom in a fresh Jupyter kernel, as `make lab` would, and records:

* its wall time (models already fetched, kernels already compiled: a warm run);
* the peak resident memory of the kernel and every process it starts (chapter 13 starts a
  server), sampled from /proc every 50 ms and summed over the process tree at each sample (the
  largest single process would understate chapter 13);
* the size of the model cache and of .venv.

It rewrites the text between the `costs:` markers of book/setup.md and exits 1 if a chapter
fails. Linux only (/proc). Run it on a quiet machine: a second busy process changes the times.

    python scripts/chapter_costs.py            # every chapter, then rewrite book/setup.md
    python scripts/chapter_costs.py --dry-run  # print the table only
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import sys
import textwrap
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHAPTERS = ROOT / "book" / "chapters"
SETUP = ROOT / "book" / "setup.md"
BEGIN, END = "<!-- costs:begin -->", "<!-- costs:end -->"


def tree_rss(root_pid: int) -> int:
    """Resident bytes of `root_pid` and all its descendants, now."""
    children: dict[int, list[int]] = {}
    rss: dict[int, int] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            text = Path(entry.path, "status").read_text()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
        pid, ppid = int(entry.name), int(fields.get("PPid", "0").strip() or 0)
        children.setdefault(ppid, []).append(pid)
        rss[pid] = int(fields.get("VmRSS", "0 kB").split()[0]) * 1024
    total, todo = 0, [root_pid]
    while todo:
        pid = todo.pop()
        total += rss.get(pid, 0)
        todo += children.get(pid, [])
    return total


def run_chapter(path: Path) -> tuple[float, int]:
    """(seconds, peak bytes of the kernel's process tree) for one chapter."""
    import jupytext
    from nbclient import NotebookClient

    nb = jupytext.read(path)
    client = NotebookClient(nb, timeout=900, kernel_name="python3",
                            resources={"metadata": {"path": str(CHAPTERS)}})
    peak, done = [0], threading.Event()

    def sample():
        while not done.is_set():
            km = client.km
            pid = getattr(getattr(km, "provisioner", None), "pid", None) if km else None
            if pid:
                peak[0] = max(peak[0], tree_rss(pid))
            time.sleep(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t = time.perf_counter()
    try:
        client.execute()
    finally:
        seconds = time.perf_counter() - t
        done.set()
        sampler.join()
    return seconds, peak[0]


def du(path: Path) -> int:
    total = 0
    for base, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(base, name)).st_size
            except OSError:
                pass
    return total


def machine() -> str:
    sys.path.insert(0, str(CHAPTERS))
    from course.machine import cpu_description      # chapter 1's own description

    name, level = cpu_description()
    return f"{name} ({level}), {os.cpu_count()} cores"


def title(path: Path) -> str:
    head = next(line[2:] for line in path.read_text().splitlines() if line.startswith("# "))
    return f"{int(path.name[:2])} · {head.split(':')[0]}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="print, do not rewrite")
    args = parser.parse_args(argv)
    from fucina_course.catalog import cache_dir

    rows, failed = [], []
    for path in sorted(CHAPTERS.glob("[0-9][0-9]_*.md")):
        try:
            seconds, peak = run_chapter(path)
        except Exception as err:                 # report every chapter, then fail
            failed.append(f"{path.name}: {type(err).__name__}: {str(err)[:200]}")
            continue
        rows.append((title(path), seconds, peak))
        print(f"{path.name}: {seconds:.0f} s, {peak / 2**30:.1f} GiB", flush=True)
    if failed:
        print("\n".join(failed), file=sys.stderr)
        return 1
    cache, venv = du(cache_dir()), du(ROOT / ".venv")
    heaviest = max(rows, key=lambda r: r[2])
    lines = [textwrap.fill(
        f"Measured on {datetime.date.today():%Y-%m-%d} on {machine()}, by "
        "`scripts/chapter_costs.py` (each chapter in a fresh kernel, top to bottom, models "
        "fetched and kernels compiled beforehand; memory is the peak of the kernel and the "
        "processes it starts, summed).", 92),
             "",
             "| Chapter | Seconds | Peak memory |", "|:--|--:|--:|"]
    lines += [f"| {name} | {s:.0f} | {b / 2**30:.1f} GiB |" for name, s, b in rows]
    lines += ["", textwrap.fill(
        f"In all: {sum(r[1] for r in rows) / 60:.1f} minutes. The most memory: "
        f"{heaviest[0]}, {heaviest[2] / 2**30:.1f} GiB. On disk: the model cache "
        f"(`~/.cache/fucina_course`) {cache / 1e9:.2f} GB, `.venv` {venv / 1e9:.2f} GB "
        "(test tools included).", 92)]
    table = "\n".join(lines)
    if args.dry_run:
        print(table)
        return 0
    text = SETUP.read_text()
    pattern = re.compile(re.escape(BEGIN) + ".*?" + re.escape(END), re.S)
    if not pattern.search(text):
        print(f"{SETUP}: no {BEGIN} ... {END} markers", file=sys.stderr)
        return 1
    SETUP.write_text(pattern.sub(lambda _: f"{BEGIN}\n{table}\n{END}", text))
    print(f"wrote {SETUP.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
