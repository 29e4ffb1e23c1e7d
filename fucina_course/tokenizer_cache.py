"""The tokenizer's built tables, kept on disk between runs.

Building a 151k-token tokenizer (unmapping every token and merge, the rank and id
dicts) takes about a third of a warm `fucina generate`; unpickling the built object
takes a small fraction of that (measured: docs/BENCHMARKS.md#tokenizer-tables-on-disk).
The tables depend only on the vocabulary and on the code that builds them, so the key
is a hash of exactly those: every file with the same vocabulary (all Qwen3 sizes, the
synthetic models) shares one entry, and an edit of tokenizer.py or pretokenizer.py
starts afresh.  Small vocabularies build faster than they load and are not cached.  An
entry that fails to unpickle is built again; a cache that cannot be written is skipped.

Where the entries live is the caller's choice (`Tokenizer.from_gguf(gguf,
cache_dir=...)`; catalog.py passes its cache directory): the tokenizer does not know
where files live.  This module knows the key and the file format, not the Tokenizer
class: `load` returns whatever the entry holds, and the tokenizer checks it.
"""

from __future__ import annotations

import hashlib
import os
import sys
from functools import lru_cache
from pathlib import Path

import numpy as np

CACHE_MIN_TOKENS = 32_768


def tables_key(gguf, types, params: dict) -> str | None:
    """sha256 of everything the built tokenizer depends on (the file's vocabulary and
    merges as stored, token types, special ids and flags; the code), or None: not
    cached.  ~5 ms: the string arrays are hashed as stored, not as 300k objects."""
    if gguf.array_length("tokenizer.ggml.tokens") < CACHE_MIN_TOKENS:
        return None
    h = hashlib.sha256(_code_stamp())
    h.update(repr((sys.version_info[:2], np.__version__,
                   sorted(params.items()))).encode())
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"):
        h.update(gguf.array_length(key).to_bytes(8, "little"))
        h.update(gguf.string_array_bytes(key))
    h.update(b"" if types is None else np.asarray(types, np.int64).tobytes())
    return h.hexdigest()


@lru_cache(maxsize=1)
def _code_stamp() -> bytes:
    """sha256 of tokenizer.py and pretokenizer.py, the code that builds the tables (read
    once per process)."""
    h = hashlib.sha256()
    here = os.path.dirname(os.path.abspath(__file__))
    for name in ("tokenizer.py", "pretokenizer.py"):
        with open(os.path.join(here, name), "rb") as f:
            h.update(f.read())
    return h.digest()


def _path(cache_dir, key: str) -> Path:
    return Path(cache_dir) / "tokenizers" / f"{key[:32]}.pickle"


def load(cache_dir, key: str | None):
    """The object saved under `key` in `cache_dir`, or None (no key, no entry, or one
    that does not unpickle)."""
    import gc
    import pickle

    if key is None or cache_dir is None:
        return None
    collecting = gc.isenabled()
    gc.disable()       # 300k+ new objects: the cyclic collector's passes cost ~25%
    try:
        with open(_path(cache_dir, key), "rb") as f:
            return pickle.load(f)
    except Exception:                   # absent, unreadable or from another version
        return None
    finally:
        if collecting:
            gc.enable()


def save(cache_dir, key: str | None, tables) -> None:
    """Keep `tables` under `key` in `cache_dir` (written whole, then renamed)."""
    import pickle

    if key is None or cache_dir is None:
        return
    try:
        path = _path(cache_dir, key)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        with open(tmp, "wb") as f:
            pickle.dump(tables, f, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(tmp, path)           # readers never see half a file
    except OSError:
        pass
