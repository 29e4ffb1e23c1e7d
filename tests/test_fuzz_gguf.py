"""A model file is untrusted input: 1,000 seeded mutations, each a clean error or a run.

The fuzzer itself lives in tests/gguf_fuzz.py (it is also a command: see its docstring);
docs/RELIABILITY.md lists the mutation kinds and the counts of the last full run.  Each
case runs in a worker process (a segfault fails one case, not the run) under a memory
cap, and does what a user does: `Model.load`, tokenize, a prefill, one decode step.

The campaign takes ~35 s on 2 busy cores here (1,000 cases, 2 workers, 2026-11-30);
speed is recorded in docs/RELIABILITY.md rather than asserted, like every timing in
this suite.
"""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import gguf_fuzz as fuzz

CASES = 1000
SEED = 20261201


@pytest.fixture(scope="module")
def bases() -> list[Path]:
    return fuzz.base_paths()


@pytest.fixture(scope="module")
def mutator(bases) -> fuzz.Mutator:
    return fuzz.Mutator(bases, SEED)  # also checks serialize(parse(base)) == base


def test_every_mutation_kind_is_exercised_and_changes_the_file(mutator):
    cases = [mutator.case(i) for i in range(3 * len(fuzz.KINDS))]
    assert {c.kind for c in cases} == set(fuzz.KINDS)
    for c in cases:
        assert c.data != mutator.raws[c.base], (c.kind, c.what)
    assert {c.must_reject for c in cases} == {True, False, None}


def test_the_same_seed_gives_the_same_cases(bases, mutator):
    again = fuzz.Mutator(bases, SEED)
    for i in (0, 17, 123, 999):
        assert again.case(i).data == mutator.case(i).data


def test_fuzz_campaign(bases, tmp_path):
    report = fuzz.run_fuzz(bases, CASES, seed=SEED, workers=2, log_dir=tmp_path)
    summary = fuzz.summarize(report)
    print(summary)
    bad = fuzz.failures(report, limit=40)
    assert not bad, (f"{len(bad)} of {CASES} cases break the promise "
                     f"(outcomes {summary['outcomes']}):\n" + "\n".join(bad))
    assert summary["outcomes"].get("clean", 0) > CASES // 2  # the mutations do bite


# `generate` must reject a file of every must-reject kind; `info` (which reads the
# container, the config and the tokenizer, not the weights) is tried on four kinds whose
# damage it sees.  Each call is a fresh process (~1-2 s of imports), hence the sample.
INFO_KINDS = {"truncate", "lying_count", "header", "tokenizer"}


def _fucina(*args: str) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).with_name("fucina")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "fucina_course"]
    return subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=300,
                          env=fuzz.worker_env())


def test_cli_reports_each_broken_file_in_one_line(mutator, tmp_path):
    sample, seen = [], set()
    for i in range(CASES):
        c = mutator.case(i)
        if c.must_reject and c.kind not in seen:
            seen.add(c.kind)
            path = tmp_path / f"case{i}-{c.kind}.gguf"
            path.write_bytes(c.data)
            sample.append((c, path))
    calls = [(c, ("generate", str(p), "--prompt", "Hello", "--gen", "2"))
             for c, p in sample]
    calls += [(c, ("info", str(p))) for c, p in sample if c.kind in INFO_KINDS]
    with ThreadPoolExecutor(2) as pool:
        done = list(pool.map(lambda call: (call, _fucina(*call[1])), calls))
    bad = []
    for (c, args), proc in done:
        lines = proc.stderr.splitlines()
        if not (proc.returncode == 1 and len(lines) == 1
                and lines[0].startswith("fucina: error: ")):
            bad.append(f"fucina {args[0]} on [{c.kind}] {c.what}: exit "
                       f"{proc.returncode}, stderr {proc.stderr[-300:]!r}")
    assert not bad, "\n".join(bad)
