"""The whole architecture of a model, as a handful of integers read from its GGUF file.

Nobody types these numbers in: `Config.from_gguf` reads them from the `<arch>.*`
metadata keys, so every Qwen3 size (0.6B ... 32B, and the 30B-A3B / 235B-A22B
mixture-of-experts) loads without hard-coding.  What differs between the near relatives
(qwen2, llama) is not a number but a switch; those live in one record per family
(families.py), which `Config` carries as `family`.

Structural counts are read with `positive=True`: a layer count or head count of zero can
only be a broken file, and saying so beats building an empty model.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from .errors import MetadataError, ShapeMismatch, UnsupportedArchitecture
from .families import FAMILIES, Family

SUPPORTED_ARCHITECTURES = tuple(FAMILIES)


@dataclass(frozen=True)
class Config:
    family: Family
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    context_length: int
    num_experts: int = 0     # mixture of experts (qwen3moe); 0 for dense models
    num_experts_used: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True

    @classmethod
    def from_gguf(cls, gguf) -> "Config":
        arch = gguf.architecture
        if arch not in FAMILIES:
            raise UnsupportedArchitecture(
                f"{gguf.path}: architecture {arch!r} is not supported "
                f"(supported: {', '.join(FAMILIES)})")
        family = FAMILIES[arch]

        def key(suffix: str) -> str:
            return f"{arch}.{suffix}"

        hidden = gguf.get_int(key("embedding_length"), positive=True)
        heads = gguf.get_int(key("attention.head_count"), positive=True)
        kv_heads = gguf.get_int(key("attention.head_count_kv"), heads, positive=True)
        head_dim = gguf.get_int(key("attention.key_length"), hidden // heads,
                                positive=True)
        if heads % kv_heads:
            raise MetadataError(f"{gguf.path}: {heads} query heads cannot be grouped "
                                f"over {kv_heads} KV heads")
        moe = family.moe
        layers = gguf.get_int(key("block_count"), positive=True)

        def moe_int(suffix: str) -> int:
            return gguf.get_int(key(suffix), positive=True) if moe else 0

        if moe and moe_int("expert_used_count") > moe_int("expert_count"):
            raise MetadataError(
                f"{gguf.path}: {moe_int('expert_used_count')} experts per token "
                f"cannot be chosen from {moe_int('expert_count')}")
        if gguf.has(key("vocab_size")):
            vocab = gguf.get_int(key("vocab_size"), positive=True)
        elif family.embedding.name in gguf.tensors:
            embd = gguf.tensors[family.embedding.name]
            if len(embd.shape) != 2:
                raise ShapeMismatch(f"{gguf.path}: {embd.name} should be 2-D, "
                                    f"has shape {list(embd.shape)}")
            vocab = embd.shape[1]
        else:
            vocab = len(gguf.get_strings("tokenizer.ggml.tokens"))
        return cls(
            family=family,
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=gguf.get_int(key("feed_forward_length"),
                                           0 if moe else None, positive=not moe),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=gguf.get_float(key("attention.layer_norm_rms_epsilon"), 1e-6),
            rope_theta=gguf.get_float(key("rope.freq_base"), 10000.0),
            context_length=gguf.get_int(key("context_length"), 4096, positive=True),
            num_experts=moe_int("expert_count"),
            num_experts_used=moe_int("expert_used_count"),
            moe_intermediate_size=moe_int("expert_feed_forward_length"),
            norm_topk_prob=(gguf.get_bool(key("expert_weights_norm"), True) if moe
                            else True),
        )

    # --- the family's switches, and derived sizes -------------------------------------

    @property
    def arch(self) -> str:
        return self.family.arch

    @property
    def rope_style(self) -> str:
        return self.family.rope_style

    @property
    def qk_norm(self) -> bool:
        return self.family.qk_norm

    @property
    def qkv_bias(self) -> bool:
        return self.family.qkv_bias

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def heads_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    def kv_bytes_per_position(self, cache_type: str = "f16") -> int:
        """Bytes the KV cache holds per token: layers x (K and V) x kv_heads x the bytes
        of one row of head_dim values (2 per value in f16; a 34-byte block per 32 in
        q8_0)."""
        if cache_type == "f16":
            per_row = self.head_dim * 2
        else:
            from gguf import GGMLQuantizationType as T

            from .quant import block_geometry

            values, nbytes = block_geometry(T.Q8_0)
            per_row = self.head_dim // values * nbytes
        return self.num_layers * 2 * self.num_kv_heads * per_row

    def as_dict(self) -> dict:
        """Every field and switch by name (the family flattened to arch + switches)."""
        out = {"arch": self.arch, "rope_style": self.rope_style,
               "qk_norm": self.qk_norm, "qkv_bias": self.qkv_bias}
        out.update({f.name: getattr(self, f.name) for f in fields(self)
                    if f.name != "family"})
        return out

