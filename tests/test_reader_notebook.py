"""A reader's JupyterLab opens a chapter as a notebook, and the notebook runs.

The chapters are MyST markdown files (`book/chapters/NN_*.md`); no `.ipynb` is committed.
A reader who runs `make lab` gets JupyterLab with jupytext's server extension, which makes
the Jupyter server hand a `.md` chapter to the browser as a notebook.  These tests take the
reader's two paths with the real tools, not with the book's build:

- the Jupyter server of the reader's install, started as `jupyter lab` starts it, answers
  the contents request the browser makes when a chapter is opened as a notebook
  (`GET /api/contents/<path>?type=notebook`) with the chapter's cells;
- the chapter converted by `jupytext --to ipynb` and executed by
  `jupyter nbconvert --execute` in the chapter's directory runs to the end with no error.

nbval (make test) already executes every chapter through pytest; this checks the route a
reader takes outside it.  The reader's packages come from requirements-reader.txt, which
requirements-dev.txt includes, so a missing one here is a failure, not a skip.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import jupytext

ROOT = Path(__file__).resolve().parent.parent
CHAPTER = ROOT / "book" / "chapters" / "01_machine.md"   # the fastest chapter (~5 s)
BIN = Path(sys.executable).parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_jupyter_server_opens_a_chapter_as_a_notebook(tmp_path):
    assert (BIN / "jupyter-lab").exists(), "jupyterlab is not installed (requirements-reader.txt)"
    port, token = _free_port(), "fucina-test"
    env = {**os.environ, "JUPYTER_CONFIG_DIR": str(tmp_path / "config"),
           "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime")}
    log = tmp_path / "server.log"     # a file, not a pipe: a full pipe would block it
    server = subprocess.Popen(
        [str(BIN / "jupyter-lab"), "--no-browser", f"--port={port}", "--ip=127.0.0.1",
         f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={ROOT}",
         "--allow-root"],  # CI runs as root
        stdout=subprocess.DEVNULL, stderr=log.open("w"), env=env)
    rel = CHAPTER.relative_to(ROOT).as_posix()
    url = f"http://127.0.0.1:{port}/api/contents/{rel}?type=notebook&content=1"
    request = urllib.request.Request(url, headers={"Authorization": f"token {token}"})
    try:
        deadline, model = time.monotonic() + 60, None
        while model is None:
            try:
                with urllib.request.urlopen(request, timeout=10) as r:
                    model = json.load(r)
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError("jupyter lab did not serve the chapter:\n"
                                         + log.read_text(errors="replace")[-2000:])
                time.sleep(0.5)
    finally:
        server.terminate()
        server.wait(timeout=30)
    assert model["type"] == "notebook"
    cells = model["content"]["cells"]
    expected = jupytext.read(CHAPTER).cells
    assert [c["cell_type"] for c in cells] == [c.cell_type for c in expected]
    assert cells[0]["source"] == expected[0].source
    kernel = model["content"]["metadata"]["kernelspec"]["name"]
    assert kernel == "python3"


def test_chapter_runs_as_a_notebook_with_nbconvert(tmp_path):
    # converted next to the chapter so that it runs in the chapter's directory, as in the
    # reader's JupyterLab; removed afterwards (the tree stays clean)
    notebook = CHAPTER.with_name(f".reader-test-{os.getpid()}.ipynb")
    executed = tmp_path / "executed.ipynb"
    try:
        subprocess.run([str(BIN / "jupytext"), "--to", "ipynb", "-o", str(notebook),
                        str(CHAPTER)], check=True, capture_output=True)
        out = subprocess.run(
            [str(BIN / "jupyter-nbconvert"), "--to", "notebook", "--execute",
             "--ExecutePreprocessor.timeout=300", "--output", str(executed), str(notebook)],
            capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
    finally:
        notebook.unlink(missing_ok=True)
        shutil.rmtree(CHAPTER.parent / ".ipynb_checkpoints", ignore_errors=True)
    nb = json.loads(executed.read_text(encoding="utf-8"))
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert code and all(c.get("execution_count") for c in code), "a code cell did not run"
    errors = [o for c in code for o in c.get("outputs", []) if o["output_type"] == "error"]
    assert not errors, errors[0]
    # the first cell's output is the default model's answer to the France question
    text = "".join("".join(o.get("text", "")) for c in code for o in c.get("outputs", []))
    assert "Paris" in text
