"""scripts/chapter_costs.py, which measures the setup page's table: its memory probe sums a
process tree (a child's memory counts), and the page keeps the markers it rewrites between."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import chapter_costs  # noqa: E402


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc")
def test_tree_rss_counts_a_childs_memory():
    child = subprocess.Popen([sys.executable, "-c",
                              "import time; x = bytearray(300 * 2**20); x[::4096] = b'1' * "
                              "len(x[::4096]); print('ready', flush=True); time.sleep(30)"],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        time.sleep(0.1)
        with_child = chapter_costs.tree_rss(child.pid)
        assert with_child > 300 * 2**20                 # the child's touched pages
        assert chapter_costs.tree_rss(999_999_999) == 0  # no such process
    finally:
        child.kill()
        child.wait()


def test_the_setup_page_has_the_markers_and_a_table_between_them():
    text = (ROOT / "book" / "setup.md").read_text()
    begin, end = text.index(chapter_costs.BEGIN), text.index(chapter_costs.END)
    table = text[begin:end]
    chapters = sorted((ROOT / "book" / "chapters").glob("[0-9][0-9]_*.md"))
    assert table.count("GiB |") == len(chapters)       # one row per chapter
    assert "Measured on " in table
