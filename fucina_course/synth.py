"""Synthetic models: valid GGUF files with the real Qwen vocabulary and random weights.

Why: the engine must be compared with llama.cpp at exact Qwen3 geometries (including the
0.6B one, for speed) and in every block format, on machines where no Qwen3 download is
possible.  A random model is as good as a trained one for that purpose: the two engines
read the very same file, so their logits must agree whatever the weights are.  Tiny
geometries make fast tests; the MoE geometry feeds the mixture-of-experts chapter.

Weights are drawn so that logits are not degenerate: embeddings and projections have the
usual 1/sqrt(fan_in) scale, norms are ~1.  Formats that gguf-py can quantize (F32, F16,
BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1) are quantized from float weights; for the K-quants
(Q4_K, Q5_K, Q6_K), which gguf-py cannot quantize, we write random *blocks* directly
(any bytes form a valid block once the float16 scale fields hold finite values), then
rescale the block scales so the decoded values have the requested standard deviation.
Every choice is driven by one seed.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as T

from .config import Config
from .families import FAMILIES
from .quant.formats import FORMATS
from .tokenizer import TokenType

log = logging.getLogger(__name__)

QUANTIZABLE = {T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1}
RANDOM_BLOCKS = {T.Q4_K, T.Q5_K, T.Q6_K}


@dataclass(frozen=True)
class SynthSpec:
    """Geometry, formats and seed of a synthetic model."""

    arch: str = "qwen3"
    vocab_size: int = 151_936        # the full Qwen3 vocabulary (smaller: `vocabulary`)
    hidden_size: int = 256
    intermediate_size: int = 512
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    context_length: int = 4096
    tied_embeddings: bool = True
    weight_type: str = "Q8_0"        # the 2-D projection matrices
    embedding_type: str | None = None  # default: same as weight_type
    output_type: str | None = None     # only used when not tied; default: weight_type
    num_experts: int = 0              # qwen3moe only
    num_experts_used: int = 0
    moe_intermediate_size: int = 0
    seed: int = 0
    name: str = field(default="synthetic")


QWEN3_0_6B = SynthSpec(hidden_size=1024, intermediate_size=3072, num_layers=28,
                       num_heads=16, num_kv_heads=8, head_dim=128, context_length=40960,
                       name="qwen3-0.6b-geometry")
TINY_QWEN3 = SynthSpec(vocab_size=4096, name="tiny-qwen3")
TINY_QWEN3_MOE = SynthSpec(arch="qwen3moe", vocab_size=4096, num_experts=8,
                           num_experts_used=2, moe_intermediate_size=256,
                           intermediate_size=512, name="tiny-qwen3-moe")
# Qwen3-30B-A3B's routing (128 experts, 8 per token) at the 0.6B's width, as many layers
# as fit in ~1 GB (Q8_0): the MoE speed comparison with llama.cpp (bench_vs_llama.py).
QWEN3_MOE_1GB = SynthSpec(arch="qwen3moe", hidden_size=1024, intermediate_size=3072,
                          num_layers=4, num_heads=16, num_kv_heads=8, head_dim=128,
                          num_experts=128, num_experts_used=8,
                          moe_intermediate_size=512,
                          context_length=40960, name="qwen3-moe-1gb-geometry")

# Qwen3-30B-A3B's geometry (its config.json: 48 layers, hidden 2048, 32 query and 4 KV
# heads of 128, 128 experts of 768 with 8 per token): `with_layers` cuts it to a model
# of the size a test needs (issue 46: ~350 MB a layer in Q4_K, a file bigger than a
# memory limit).  The embeddings are tied here (the real model's are not): less to
# write, the same per-token work in the layers.
QWEN3_30B_A3B = SynthSpec(arch="qwen3moe", hidden_size=2048, intermediate_size=6144,
                          num_layers=48, num_heads=32, num_kv_heads=4, head_dim=128,
                          num_experts=128, num_experts_used=8,
                          moe_intermediate_size=768, context_length=40960,
                          name="qwen3-30b-a3b-geometry")


def with_layers(spec: SynthSpec, layers: int) -> SynthSpec:
    """`spec` with `layers` layers (its name says so)."""
    if layers < 1:
        raise ValueError(f"layers must be at least 1, got {layers}")
    return replace(spec, num_layers=layers, name=f"{spec.name}-{layers}l")


def vocabulary(vocab_size: int) -> dict:
    """The Qwen3 vocabulary, or a consistent prefix of it.

    A prefix of n entries keeps the n-3 lowest-ranked byte tokens with exactly the
    merges that build them (merge i creates token 256 + i), then the three ChatML
    markers.
    """
    from .gguf_file import GGUFFile
    from .catalog import qwen3_vocab_path

    g = GGUFFile(qwen3_vocab_path())
    tokens = [t.decode() for t in g.get_strings("tokenizer.ggml.tokens")]
    types = np.asarray(g.get_array("tokenizer.ggml.token_type")).tolist()
    merges = [m.decode() for m in g.get_strings("tokenizer.ggml.merges")]
    if vocab_size >= len(tokens):
        return {"tokens": tokens, "token_types": types, "merges": merges,
                "bos": 151643, "eos": 151645}
    if vocab_size < 260:
        raise ValueError("a truncated vocabulary needs at least 256 byte tokens "
                         "+ 3 markers + 1")
    keep = vocab_size - 3
    markers = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    control = [int(TokenType.CONTROL)] * 3
    return {"tokens": tokens[:keep] + markers, "token_types": types[:keep] + control,
            "merges": merges[:keep - 256], "bos": keep, "eos": keep + 2}


def _encode(w: np.ndarray, qtype: T) -> np.ndarray:
    if qtype == T.F32:
        return w.astype(np.float32)
    if qtype == T.F16:
        return w.astype(np.float16)
    return gguf.quants.quantize(w.astype(np.float32), qtype)


def _random_k_blocks(rng: np.random.Generator, rows: int, cols: int, qtype: T,
                     std: float) -> np.ndarray:
    """Random valid K-quant blocks for a [rows, cols] matrix, decoded values ~`std`."""
    fmt = FORMATS[qtype]
    nb = cols // fmt.block_size
    raw = rng.integers(0, 256, size=(rows, nb, fmt.block_bytes), dtype=np.uint8)
    fields = fmt.f16_fields                              # d (and dmin)
    scales = np.full((rows, nb, len(fields)), 1.0, dtype=np.float16)
    if len(fields) == 2:  # d and dmin: centre the (d*sc*q - dmin*m) distribution
        scales[..., 1] = 7.5 if qtype == T.Q4_K else 15.5
    for j, off in enumerate(fields):
        raw[..., off:off + 2] = scales[..., j:j + 1].view(np.uint8)
    n = min(rows, 64)
    sample = gguf.quants.dequantize(raw[:n].reshape(n, -1), qtype)
    factor = std / max(float(np.std(sample)), 1e-12)
    for j, off in enumerate(fields):
        scaled = (scales[..., j:j + 1].astype(np.float32) * factor).astype(np.float16)
        raw[..., off:off + 2] = scaled.view(np.uint8)
    return raw.reshape(rows, -1)


class _TensorMaker:
    def __init__(self, spec: SynthSpec):
        self.spec, self.rng = spec, np.random.default_rng(spec.seed)

    def matrix(self, rows: int, cols: int, type_name: str,
               std: float) -> tuple[np.ndarray, T]:
        qtype = T[type_name]
        if qtype in RANDOM_BLOCKS:
            if cols % 256:
                raise ValueError(f"{type_name} needs rows of a multiple of 256 values, "
                                 f"got {cols}")
            return _random_k_blocks(self.rng, rows, cols, qtype, std), qtype
        if qtype not in QUANTIZABLE:
            raise ValueError(f"synthetic models cannot be written in {type_name}")
        w = self.rng.standard_normal((rows, cols), dtype=np.float32) * np.float32(std)
        return _encode(w, qtype), qtype

    def norm(self, n: int) -> np.ndarray:
        return (1.0 + 0.1 * self.rng.standard_normal(n)).astype(np.float32)

    def bias(self, n: int) -> np.ndarray:
        return (0.02 * self.rng.standard_normal(n)).astype(np.float32)

    def tensor(self, t, cfg, type_name: str, std: float | None = None):
        """(data, type) of a table entry (families.TensorSpec): norms ~1, matrices
        ~1/sqrt(n_in) (`std` overrides), a router in F32, an expert stack as E
        matrices."""
        shape = t.shape(cfg)
        if len(shape) == 1:
            return self.norm(shape[0]), T.F32
        n_out, n_in = shape[-2:]
        if t.float32:                    # the router: F32 in every converter's output
            w = self.rng.standard_normal((n_out, n_in), dtype=np.float32)
            w /= np.float32(np.sqrt(n_in))
            return w, T.F32
        std = 1.0 / np.sqrt(n_in) if std is None else std
        if len(shape) == 2:
            return self.matrix(n_out, n_in, type_name, std)
        mats = [self.matrix(n_out, n_in, type_name, std) for _ in range(shape[0])]
        return np.stack([m for m, _ in mats]), mats[0][1]


def _logical_shape(data: np.ndarray, qtype: T) -> tuple[int, int]:
    if data.dtype != np.uint8:
        return data.shape[0], data.shape[-1]
    fmt = FORMATS[qtype]
    return data.shape[0], data.shape[-1] // fmt.block_bytes * fmt.block_size


def write_synthetic(spec: SynthSpec, path: str | os.PathLike, *,
                    metadata_overrides: dict | None = None,
                    type_overrides: dict[str, str] | None = None,
                    embedding_std: float = 0.05,
                    progress: bool = False) -> Path:
    """Write `spec` as a GGUF file llama.cpp can load (if it knows the family); returns
    the path.

    `metadata_overrides` ({key: value}) and `type_overrides` ({tensor name: format})
    exist to write deliberately broken files for the error tests; `embedding_std`
    larger than the default gives hidden states dominated by the token's own embedding
    (synth_router.py: routes that spread over the experts).
    """
    s = spec
    if s.arch not in FAMILIES:
        raise ValueError(f"no family {s.arch!r} to write "
                         f"(known: {', '.join(FAMILIES)})")
    vocab = vocabulary(s.vocab_size)
    mk = _TensorMaker(s)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    meta = _metadata(s, vocab)
    for key, value in (metadata_overrides or {}).items():  # tests write broken files
        kind = ("bool" if isinstance(value, bool) else
                "float32" if isinstance(value, float) else "uint32")
        meta[key] = (meta[key][0] if key in meta else kind, value)
    w = gguf.GGUFWriter(str(tmp), s.arch)
    for key, (kind, value) in meta.items():
        if key != "general.architecture":
            getattr(w, f"add_{kind}")(key, value)
    for name, (data, qtype) in _tensors(s, _config(s, len(vocab["tokens"])), mk,
                                        embedding_std):
        if name in (type_overrides or {}):  # random bytes, another (maybe unsupported)
            data, qtype = _random_bytes(mk.rng, data, qtype, T[type_overrides[name]])
        w.add_tensor(name, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=progress)
    w.close()
    os.replace(tmp, path)
    return path


def _random_bytes(rng, data: np.ndarray, qtype: T, other: T):
    """(random blocks, other) for the tensor `data` of `qtype`, retyped as `other`
    (any format: gguf-py's table knows them all; the error tests)."""
    block, size = gguf.constants.GGML_QUANT_SIZES[other]
    n_out, n_in = _logical_shape(data, qtype)
    return rng.integers(0, 256, size=(n_out, n_in // block * size), dtype=np.uint8), other


def _metadata(s: SynthSpec, vocab: dict) -> dict[str, tuple[str, object]]:
    """{key: (GGUF value kind, value)}: the config's keys, the vocabulary, ChatML."""
    from .qwen_vocab import CHATML_TEMPLATE

    a = s.arch
    meta: dict[str, tuple[str, object]] = {
        "general.name": ("string",
                         f"{s.name} (synthetic, random weights, seed {s.seed})"),
        f"{a}.context_length": ("uint32", s.context_length),
        f"{a}.embedding_length": ("uint32", s.hidden_size),
        f"{a}.block_count": ("uint32", s.num_layers),
        f"{a}.feed_forward_length": ("uint32", s.intermediate_size),
        f"{a}.attention.head_count": ("uint32", s.num_heads),
        f"{a}.attention.head_count_kv": ("uint32", s.num_kv_heads),
        f"{a}.attention.key_length": ("uint32", s.head_dim),
        f"{a}.attention.value_length": ("uint32", s.head_dim),
        f"{a}.rope.freq_base": ("float32", s.rope_theta),
        f"{a}.attention.layer_norm_rms_epsilon": ("float32", s.rms_norm_eps),
    }
    if FAMILIES[a].moe:
        meta.update({f"{a}.expert_count": ("uint32", s.num_experts),
                     f"{a}.expert_used_count": ("uint32", s.num_experts_used),
                     f"{a}.expert_feed_forward_length":
                         ("uint32", s.moe_intermediate_size)})
    meta.update({
        "tokenizer.ggml.model": ("string", "gpt2"),
        "tokenizer.ggml.pre": ("string", "qwen2"),
        "tokenizer.ggml.tokens": ("array", vocab["tokens"]),
        "tokenizer.ggml.token_type": ("array", vocab["token_types"]),
        "tokenizer.ggml.merges": ("array", vocab["merges"]),
        "tokenizer.ggml.bos_token_id": ("uint32", vocab["bos"]),
        "tokenizer.ggml.eos_token_id": ("uint32", vocab["eos"]),
        "tokenizer.ggml.add_bos_token": ("bool", False),
        "tokenizer.chat_template": ("string", CHATML_TEMPLATE),
    })
    return meta


def _config(s: SynthSpec, n_vocab: int) -> Config:
    """The Config the file will have: its family's tensor table sizes the tensors."""
    return Config(family=FAMILIES[s.arch], vocab_size=n_vocab,
                  hidden_size=s.hidden_size,
                  intermediate_size=s.intermediate_size, num_layers=s.num_layers,
                  num_heads=s.num_heads, num_kv_heads=s.num_kv_heads,
                  head_dim=s.head_dim, rms_norm_eps=s.rms_norm_eps,
                  rope_theta=s.rope_theta, context_length=s.context_length,
                  num_experts=s.num_experts, num_experts_used=s.num_experts_used,
                  moe_intermediate_size=s.moe_intermediate_size)


def _tensors(s: SynthSpec, cfg: Config, mk: "_TensorMaker", embedding_std: float):
    """(GGUF name, (data, type)) of every tensor, in the family table's order (which
    is also the order of the random draws: a spec always gives the same bytes)."""
    fam = cfg.family
    for t in fam.model:
        if t.optional and s.tied_embeddings:
            continue
        kind = {"embedding": s.embedding_type, "lm_head": s.output_type}.get(t.role)
        std = embedding_std if t.role == "embedding" else None
        yield t.name, mk.tensor(t, cfg, kind or s.weight_type, std)
    for i in range(cfg.num_layers):
        for t in fam.layer:
            yield f"blk.{i}.{t.name}", mk.tensor(t, cfg, s.weight_type)
            if t.bias:
                yield f"blk.{i}.{t.bias}", (mk.bias(t.shape(cfg)[0]), T.F32)


def cached_path_for(spec: SynthSpec, variant: str = "") -> Path:
    """Where the cache keeps `spec` (its name encodes the spec; `variant` marks a file
    changed after writing, e.g. synth_router's routers)."""
    from .catalog import cache_dir

    import hashlib

    key = hashlib.sha1(repr(spec).encode()).hexdigest()[:10]
    extra = f"-{variant}" if variant else ""
    name = f"{spec.name}-{spec.weight_type.lower()}-s{spec.seed}-{key}{extra}.gguf"
    return cache_dir() / "synth" / name


def cached_synthetic(spec: SynthSpec) -> Path:
    """A synthetic model in the cache dir (written on first use; the name encodes the
    spec)."""
    path = cached_path_for(spec)
    if not path.is_file():
        # A log record, not a print: a chapter's page must not depend on whether the
        # file was already in the cache (issue 22: a reader's first build showed these
        # lines, a warm build did not).  The CLI and bench/ scripts show INFO records;
        # the progress bar only appears on a terminal.
        log.info(
            "writing synthetic model %s (first use; the 0.6B geometry takes ~20 s)",
            path.name)
        write_synthetic(spec, path, progress=sys.stderr.isatty())
    return path


def with_format(spec: SynthSpec, weight_type: str, **changes) -> SynthSpec:
    return replace(spec, weight_type=weight_type, **changes)


def dense_twin(spec: SynthSpec, experts: int) -> SynthSpec:
    """A dense qwen3 of a MoE spec's geometry whose FFN is as wide as `experts` of its
    experts: k of them (the same parameters per token) or all E (the same in total)."""
    return replace(spec, arch="qwen3", num_experts=0, num_experts_used=0,
                   intermediate_size=experts * spec.moe_intermediate_size,
                   moe_intermediate_size=0, name=f"{spec.name}-dense-{experts}x")
