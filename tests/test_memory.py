"""Loading maps the file: resident memory stays below file size + KV cache + 300 MB.

Measured in a fresh subprocess (the test process has other models loaded), after a first
run that compiled the kernels into the on-disk cache: compiling is a first-start
transient (LLVM's working memory: a cold first run of this script peaked ~230 MB higher,
2026-11-30), not what a loaded model occupies.  The budget covers the interpreter,
numpy/numba/llvmlite (~100 MB), the tokenizer's tables (~100 MB) and scratch buffers; the
weights themselves are the file's pages, mapped, never copied or widened.
"""

from __future__ import annotations

import json
import subprocess
import sys

SCRIPT = r"""
import json, os, resource, sys
from fucina_course.model import Model
m = Model.load(sys.argv[1])
cache = m.new_cache(512)
m.generate(m.tokenizer.encode("The capital of France is"), 8, cache=cache, stop_ids=set())
print(json.dumps({"peak_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                  "file": os.path.getsize(sys.argv[1]), "kv": cache.nbytes}))
"""


def test_resident_memory_budget(coder_path):
    for _ in range(2):  # the first run may compile kernels; the second is measured
        out = subprocess.run([sys.executable, "-c", SCRIPT, str(coder_path)],
                             capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout.strip().splitlines()[-1])
    peak = r["peak_kb"] * 1024
    budget = r["file"] + r["kv"] + 300 * 2**20
    assert peak < budget, f"peak RSS {peak / 2**20:.0f} MiB > budget {budget / 2**20:.0f} MiB"
