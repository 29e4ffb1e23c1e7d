"""fucina_course: a Qwen3 inference engine built from scratch, one module per concept.

Data flows top to bottom: gguf_file -> config -> tokenizer -> quant -> weights -> ops -> kv_cache
-> model -> chat.  The names re-exported here are the public API; everything else may change
between chapters.

Importing the package is cheap on purpose: the public names are loaded on first use (PEP 562), so
`fucina --threads N` can size the BLAS thread pool before numpy (and its OpenBLAS) is loaded.
For the same reason the package sets one OpenBLAS default here, before anything imports numpy:

* `OPENBLAS_THREAD_TIMEOUT=4` (unless already set).  After every multi-threaded GEMM, OpenBLAS's
  worker threads busy-wait for ~2^28 cycles (~0.1 s) before sleeping.  Prefill alternates BLAS
  GEMMs (attention) with numba kernels, and the spinning worker takes half of the 2 cores from
  them: a 64-token prefill of the Qwen3-0.6B-geometry Q4_K model ran at 104 tok/s with the default
  and 174 tok/s with a short timeout (quant/prefill.py has the measurements).  OpenBLAS reads the
  variable once, when numpy loads it, so in a notebook that imported numpy first it has no effect
  (results are the same; only speed differs).
"""

import os as _os

_os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")

_PUBLIC = {
    "Config": "config",
    "GGUFFile": "gguf_file", "TensorInfo": "gguf_file", "open_gguf": "gguf_file",
    "Tokenizer": "tokenizer", "StreamDecoder": "tokenizer", "TokenType": "tokenizer",
    "KvCache": "kv_cache",
    "Model": "model",
    "load_model": "catalog",
    **{name: "errors" for name in (
        "FucinaError", "ModelFileError", "MetadataError", "UnsupportedArchitecture", "UnsupportedFormat",
        "ShapeMismatch", "TokenizerError", "InvalidSequenceLength", "KvCacheOverflow",
        "KvCacheHeadDimNotBlockAligned", "ContextFull", "ModelNotFound", "DownloadError")},
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'fucina_course' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_PUBLIC))
