"""Hostile-input checks between "the container parsed" and "the kernels run".

A GGUF file is untrusted input, and the numba kernels have no bounds checks: a matrix
whose bytes are fewer than its shape says, a norm with the wrong length, a head count
that does not divide, would read out of bounds or compute garbage without a word.  The
container itself is checked when it is opened (gguf_file.py: counts, offsets, layout);
this module checks what the *model* needs from it, as pure functions of a `GGUFFile`,
a `Config` and arrays, so each check is tested on its own (tests/test_validate.py) and
the fuzzer (tests/test_fuzz_gguf.py) sees them through `Model.load` as a user would.

| function                 | checks                                | raises            |
|--------------------------|---------------------------------------|-------------------|
| `check_metadata(g)`      | known keys hold their kind of value   | MetadataError     |
| `check_config(cfg, g)`   | values positive, sane, coherent       | MetadataError     |
| `check_tensors(g, cfg)`  | implied tensors present, exact shape, | MetadataError,    |
|                          | allowed type; none left over; norms   | ShapeMismatch,    |
|                          | and biases finite                     | UnsupportedFormat,|
|                          |                                       | NonFiniteValues   |
| `check_vocabulary(...)`  | tokenizer ids == embedding rows       | TokenizerError    |
| `check_model_file(...)`  | the four above, in that order         |                   |
| `check_finite(x, where)` | no NaN/inf (logits; layers if asked)  | NonFiniteValues   |

The limits below are stated, generous, and bound what a file can make the engine
allocate; every real model is far inside them (the largest Qwen3, 235B-A22B: 94 layers,
4,096 hidden, 64 heads, 128 experts, 40,960 positions; Llama 3.1 405B: 16,384 hidden,
128 heads, 53,248 FFN).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType

from .errors import (MetadataError, NonFiniteValues, ShapeMismatch, TokenizerError,
                     UnsupportedFormat)

if TYPE_CHECKING:
    from .config import Config
    from .gguf_file import GGUFFile

MAX_LAYERS = 1024
MAX_HIDDEN = 1 << 16          # 65,536
MAX_HEADS = 1024
MAX_HEAD_DIM = 1024
MAX_FFN = 1 << 18             # 262,144
MAX_VOCAB = 1 << 21           # 2,097,152 (tokenizer.MAX_VOCAB)
MAX_EXPERTS = 1024
MAX_CONTEXT = 1 << 22         # 4,194,304 positions (the longest real ones: ~1M)

_INT = "an integer"
_FLOAT = "a float"
_BOOL = "a bool"
_STR = "a string"
_STRS = "an array of strings"
_INTS = "an array of integers"

# Keys the engine (or llama.cpp, for the same file) reads, with the kind of value each
# must hold.  `{arch}` is the file's architecture.  A known key of the wrong kind is a
# broken file even when this engine happens not to read it: llama.cpp would refuse it.
KNOWN_KEYS: dict[str, str] = {
    "general.architecture": _STR, "general.name": _STR, "general.file_type": _INT,
    "general.quantization_version": _INT,
    "{arch}.context_length": _INT, "{arch}.embedding_length": _INT,
    "{arch}.block_count": _INT, "{arch}.feed_forward_length": _INT,
    "{arch}.attention.head_count": _INT, "{arch}.attention.head_count_kv": _INT,
    "{arch}.attention.key_length": _INT, "{arch}.attention.value_length": _INT,
    "{arch}.attention.layer_norm_rms_epsilon": _FLOAT,
    "{arch}.rope.freq_base": _FLOAT, "{arch}.rope.dimension_count": _INT,
    "{arch}.vocab_size": _INT, "{arch}.expert_count": _INT,
    "{arch}.expert_used_count": _INT, "{arch}.expert_feed_forward_length": _INT,
    "{arch}.expert_weights_norm": _BOOL,
    "tokenizer.ggml.model": _STR, "tokenizer.ggml.pre": _STR,
    "tokenizer.ggml.tokens": _STRS, "tokenizer.ggml.merges": _STRS,
    "tokenizer.ggml.token_type": _INTS,
    "tokenizer.ggml.bos_token_id": _INT, "tokenizer.ggml.eos_token_id": _INT,
    "tokenizer.ggml.eot_token_id": _INT, "tokenizer.ggml.padding_token_id": _INT,
    "tokenizer.ggml.unknown_token_id": _INT,
    "tokenizer.ggml.add_bos_token": _BOOL, "tokenizer.ggml.add_eos_token": _BOOL,
    "tokenizer.ggml.add_space_prefix": _BOOL, "tokenizer.chat_template": _STR,
}

_INTS_T = {GGUFValueType.UINT8, GGUFValueType.INT8, GGUFValueType.UINT16,
           GGUFValueType.INT16, GGUFValueType.UINT32, GGUFValueType.INT32,
           GGUFValueType.UINT64, GGUFValueType.INT64}
_ALLOWED_TYPES = {
    _INT: lambda t: len(t) == 1 and t[0] in _INTS_T,
    _FLOAT: lambda t: t in ([GGUFValueType.FLOAT32], [GGUFValueType.FLOAT64]),
    _BOOL: lambda t: t == [GGUFValueType.BOOL],
    _STR: lambda t: t == [GGUFValueType.STRING],
    _STRS: lambda t: t == [GGUFValueType.ARRAY, GGUFValueType.STRING],
    _INTS: lambda t: len(t) == 2 and t[0] == GGUFValueType.ARRAY and t[1] in _INTS_T,
}

# Norms and biases: model.py reads them as float32 views.
VECTOR_TYPES = frozenset({GGMLQuantizationType.F32})


# --- metadata and config --------------------------------------------------------------

def check_metadata(gguf: GGUFFile) -> None:
    """Every known key present in the file holds its kind of value (KNOWN_KEYS)."""
    arch = gguf.get_str("general.architecture", "") if gguf.has(
        "general.architecture") else ""
    for pattern, kind in KNOWN_KEYS.items():
        key = pattern.format(arch=arch)
        field = gguf.fields.get(key)
        if field is not None and not _ALLOWED_TYPES[kind](list(field.types)):
            got = "/".join(t.name for t in field.types)
            raise MetadataError(f"{gguf.path}: metadata key {key!r} should be {kind}, "
                                f"is {got}")


def check_config(cfg: Config, gguf: GGUFFile | None = None) -> None:
    """Every config value positive, consistent with the others, and within the limits.

    With `gguf`, also the keys `Config` derives or ignores: without `key_length` the
    head size is hidden / heads (so heads must divide hidden); `value_length` and
    `rope.dimension_count`, when present, must equal the head size (this engine has one
    head size for K and V, and rotates all of it).
    """
    where = f"{gguf.path}: " if gguf is not None else ""
    arch = cfg.arch

    def fail(key: str, value, rule: str):
        raise MetadataError(f"{where}metadata key '{arch}.{key}' is {value}; {rule}")

    def bounded(key: str, value: int, limit: int, low: int = 1):
        if not low <= value <= limit:
            fail(key, f"{value:,}", f"it must be in {low:,}..{limit:,}")

    bounded("embedding_length", cfg.hidden_size, MAX_HIDDEN)
    bounded("block_count", cfg.num_layers, MAX_LAYERS)
    bounded("attention.head_count", cfg.num_heads, MAX_HEADS)
    bounded("attention.head_count_kv", cfg.num_kv_heads, cfg.num_heads)
    if cfg.num_heads % cfg.num_kv_heads:
        fail("attention.head_count_kv", cfg.num_kv_heads,
             f"it must divide the {cfg.num_heads} query heads")
    bounded("attention.key_length", cfg.head_dim, MAX_HEAD_DIM, 2)
    if cfg.head_dim % 2:
        fail("attention.key_length", cfg.head_dim,
             "RoPE rotates channel pairs, so it must be even")
    bounded("vocab_size", cfg.vocab_size, MAX_VOCAB)
    bounded("context_length", cfg.context_length, MAX_CONTEXT)
    if cfg.family.moe:
        bounded("expert_count", cfg.num_experts, MAX_EXPERTS)
        bounded("expert_used_count", cfg.num_experts_used, cfg.num_experts)
        bounded("expert_feed_forward_length", cfg.moe_intermediate_size, MAX_FFN)
    else:
        bounded("feed_forward_length", cfg.intermediate_size, MAX_FFN)
    eps = cfg.rms_norm_eps
    if not (math.isfinite(eps) and 0 < eps < 1):
        fail("attention.layer_norm_rms_epsilon", eps, "it must be in (0, 1)")
    if not (math.isfinite(cfg.rope_theta) and cfg.rope_theta > 0):
        fail("rope.freq_base", cfg.rope_theta, "it must be a positive number")
    if gguf is None:
        return
    if not gguf.has(f"{arch}.attention.key_length") and cfg.hidden_size % cfg.num_heads:
        fail("embedding_length", cfg.hidden_size,
             f"without attention.key_length it must be a multiple of the "
             f"{cfg.num_heads} heads")
    for key in ("attention.value_length", "rope.dimension_count"):
        if gguf.has(f"{arch}.{key}"):
            value = gguf.get_int(f"{arch}.{key}")
            if value != cfg.head_dim:
                fail(key, value, f"this engine needs it equal to the head size "
                                 f"({cfg.head_dim})")


# --- tensors --------------------------------------------------------------------------

def expected_tensors(cfg: Config) -> dict[str, tuple[tuple[int, ...], str]]:
    """{tensor name: (GGML-order shape, "vector" | "matrix")} the config implies: its
    family's table (families.py) for this many layers.

    GGML order: the innermost (contiguous) dimension first, so a weight `[n_out, n_in]`
    is listed as `(n_in, n_out)`.  Optional tensors (the lm_head of a tied model) are
    not listed; `check_tensors` checks them when present.
    """
    fam = cfg.family
    specs = [("", t) for t in fam.model if not t.optional]
    specs += [(f"blk.{i}.", t) for i in range(cfg.num_layers) for t in fam.layer]
    return _entries(specs, cfg)


def _entries(specs, cfg: Config) -> dict[str, tuple[tuple[int, ...], str]]:
    out = {}
    for prefix, t in specs:
        shape = t.ggml_shape(cfg)
        out[prefix + t.name] = (shape, "vector" if len(shape) == 1 else "matrix")
        if t.bias:
            out[prefix + t.bias] = (shape[-1:], "vector")
    return out


def check_tensors(gguf: GGUFFile, cfg: Config) -> None:
    """Every tensor the config implies is present, with that exact shape and a type the
    engine computes with; no tensor is left over; norm weights and biases are finite.

    Exact shape, not just element count: a norm stored as `[1, 1, h]` has the right
    bytes but is not what any converter writes.  A leftover tensor is an error because
    llama.cpp refuses one too ("wrong number of tensors"), and because it may be a
    part the engine does not implement (`rope_freqs.weight` of Llama 3.1 scaled RoPE):
    running without it would compute a different model than the file describes.
    """
    from .quant import check_supported

    expected = expected_tensors(cfg)
    expected.update(_entries([("", t) for t in cfg.family.model
                              if t.optional and t.name in gguf.tensors], cfg))
    for name, (shape, kind) in expected.items():
        t = gguf.tensors.get(name)
        if t is None:
            raise MetadataError(f"{gguf.path}: tensor {name!r} is missing (a "
                                f"{cfg.arch} model with {cfg.num_layers} layers needs "
                                "it)")
        if t.shape != shape:
            raise ShapeMismatch(f"{gguf.path}: tensor {name!r} has shape "
                                f"{list(t.shape)} but the config implies {list(shape)} "
                                "(GGML order, innermost first)")
        if kind == "vector":
            if t.ggml_type not in VECTOR_TYPES:
                raise UnsupportedFormat(f"{gguf.path}: tensor {name!r} is "
                                        f"{t.type_name}; norm weights and biases must "
                                        "be F32")
            try:  # a few KiB each: cheap, and an inf here would poison every token
                check_finite(t.data.view(np.float32), f"tensor {name!r}")
            except NonFiniteValues as e:
                raise NonFiniteValues(f"{gguf.path}: {e}") from None
        else:
            check_supported(t.ggml_type, name)
    extra = [name for name in gguf.tensors if name not in expected]
    if extra:
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise MetadataError(f"{gguf.path}: tensor {extra[0]!r}{more} is not part of "
                            f"a {cfg.arch} model as this engine runs it")


# --- vocabulary -----------------------------------------------------------------------

def check_vocabulary(cfg: Config, tokenizer, path=None) -> None:
    """The tokenizer's ids are exactly the embedding's rows (llama.cpp's rule).

    More tokens than rows would let the tokenizer produce ids the embedding cannot look
    up; fewer would let the model sample ids the tokenizer cannot decode.
    """
    if tokenizer is None:
        return
    where = f"{path}: " if path is not None else ""
    if tokenizer.vocab_size != cfg.vocab_size:
        raise TokenizerError(f"{where}the vocabulary has {tokenizer.vocab_size:,} "
                             f"tokens but the model has {cfg.vocab_size:,} embedding "
                             "rows")


def check_model_file(gguf: GGUFFile, cfg: Config, tokenizer=None) -> None:
    """All the load-time checks, in order (metadata, config, tensors, vocabulary)."""
    check_metadata(gguf)
    check_config(cfg, gguf)
    check_tensors(gguf, cfg)
    check_vocabulary(cfg, tokenizer, gguf.path)


# --- numeric health -------------------------------------------------------------------

def check_finite(values: np.ndarray, where: str) -> np.ndarray:
    """`values` unchanged if all entries are finite, else `NonFiniteValues` (`where`).

    One `isfinite` pass: ~40 us for Qwen's 151,936 logits, nothing next to a decode
    step (tens of ms), so the logits are checked on every step; per-layer hidden states
    only when asked (model.py's `check_numerics`), to name the first layer that went
    bad.
    """
    finite = np.isfinite(values)
    if not finite.all():
        bad = int(finite.size - np.count_nonzero(finite))
        first = int(np.flatnonzero(~finite.reshape(-1))[0])
        raise NonFiniteValues(f"{where} contains {bad:,} NaN/inf value"
                              f"{'s' if bad > 1 else ''} of {finite.size:,} (first at "
                              f"flat index {first:,})")
    return values


def check_logits(logits: np.ndarray, path=None) -> np.ndarray:
    """The forward pass's output, checked: non-finite logits are never sampled from."""
    try:
        return check_finite(logits, "the logits")
    except NonFiniteValues as e:
        where = f"{path}: " if path is not None else ""
        raise NonFiniteValues(f"{where}{e}: the model's weights or config are broken "
                              "(check_numerics=True names the first layer that goes "
                              "non-finite)") from None
