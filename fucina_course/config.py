"""The whole architecture of a model, as a handful of integers read from its GGUF file.

Nobody types these numbers in: `Config.from_gguf` reads them from the `<arch>.*` metadata keys, so
every Qwen3 size (0.6B ... 32B, and the 30B-A3B / 235B-A22B mixture-of-experts) loads without
hard-coding.  The near relatives share the code path and differ by three flags:

| architecture | q/k RMSNorm | QKV bias | RoPE pairing            |
|--------------|-------------|----------|-------------------------|
| `qwen3`      | yes         | no       | "neox" (i with i + d/2) |
| `qwen3moe`   | yes         | no       | "neox"                  |
| `qwen2`      | no          | yes      | "neox"                  |
| `llama`      | no          | no       | "normal" (2i with 2i+1) |

Structural counts are read with `positive=True`: a layer count or head count of zero can only be a
broken file, and saying so beats building an empty model.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from .errors import MetadataError, UnsupportedArchitecture

SUPPORTED_ARCHITECTURES = ("qwen3", "qwen3moe", "qwen2", "llama")


@dataclass(frozen=True)
class Config:
    arch: str
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
    rope_style: str          # "neox" (half-split pairs) or "normal" (interleaved pairs)
    qk_norm: bool            # per-head RMSNorm on q and k (Qwen3)
    qkv_bias: bool           # bias on the q/k/v projections (Qwen2)
    num_experts: int = 0     # mixture of experts (qwen3moe); 0 for dense models
    num_experts_used: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True

    @classmethod
    def from_gguf(cls, gguf) -> "Config":
        arch = gguf.architecture
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedArchitecture(
                f"{gguf.path}: architecture {arch!r} is not supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)})")

        def key(suffix: str) -> str:
            return f"{arch}.{suffix}"

        hidden = gguf.get_int(key("embedding_length"), positive=True)
        heads = gguf.get_int(key("attention.head_count"), positive=True)
        kv_heads = gguf.get_int(key("attention.head_count_kv"), heads, positive=True)
        head_dim = gguf.get_int(key("attention.key_length"), hidden // heads, positive=True)
        if heads % kv_heads:
            raise MetadataError(f"{gguf.path}: {heads} query heads cannot be grouped over {kv_heads} KV heads")
        moe = arch == "qwen3moe"
        layers = gguf.get_int(key("block_count"), positive=True)
        if gguf.has(key("vocab_size")):
            vocab = gguf.get_int(key("vocab_size"), positive=True)
        elif "token_embd.weight" in gguf.tensors:
            vocab = gguf.tensors["token_embd.weight"].shape[1]
        else:
            vocab = len(gguf.get_strings("tokenizer.ggml.tokens"))
        return cls(
            arch=arch,
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=gguf.get_int(key("feed_forward_length"), 0 if moe else None, positive=not moe),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=gguf.get_float(key("attention.layer_norm_rms_epsilon"), 1e-6),
            rope_theta=gguf.get_float(key("rope.freq_base"), 10000.0),
            context_length=gguf.get_int(key("context_length"), 4096, positive=True),
            rope_style="normal" if arch == "llama" else "neox",
            qk_norm=arch in ("qwen3", "qwen3moe"),
            qkv_bias=arch == "qwen2",
            num_experts=gguf.get_int(key("expert_count"), positive=True) if moe else 0,
            num_experts_used=gguf.get_int(key("expert_used_count"), positive=True) if moe else 0,
            moe_intermediate_size=gguf.get_int(key("expert_feed_forward_length"), positive=True) if moe else 0,
            norm_topk_prob=gguf.get_bool(key("expert_weights_norm"), True) if moe else True,
        )

    # --- derived sizes --------------------------------------------------------------------------

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
        """Bytes the KV cache holds per token: layers x (K and V) x kv_heads x head_dim x element size."""
        per_row = self.head_dim * 2 if cache_type == "f16" else self.head_dim // 32 * 34
        return self.num_layers * 2 * self.num_kv_heads * per_row

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}
