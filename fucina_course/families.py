"""Model families: what one architecture does differently from its relatives, one record
each, and the tensors a model of it has.

The engine runs one transformer (model.py).  The families it loads share the metadata
keys (`<arch>.*`, config.py) and the forward pass, and differ in a few switches:

| family     | q/k norm | QKV bias | RoPE pairs              | FFN                |
|------------|----------|----------|-------------------------|--------------------|
| `qwen3`    | yes      | no       | "neox" (i with i + d/2) | dense SwiGLU       |
| `qwen3moe` | yes      | no       | "neox"                  | mixture of experts |
| `qwen2`    | no       | yes      | "neox"                  | dense SwiGLU       |
| `llama`    | no       | no       | "normal" (2i with 2i+1) | dense SwiGLU       |

A family is its RoPE style plus a table of tensors (`TensorSpec`): each one's role in
the engine, its GGUF name and its shape in terms of the config.  The switches are read
off the table (a family with `q_norm` tensors normalizes q and k per head), so the table
is the single description of an architecture: `Model.load` reads the tensors it lists
(weights.py, `WeightReader.load`), `validate.check_tensors` checks a file against it
and `synth.write_synthetic` writes files from it.  This is the only module that spells
a GGUF tensor name (tests/test_families.py holds that).

Whether the output projection (lm_head) is tied to the embedding table is a property of
the file, not of the family (Qwen3-0.6B ties it, Qwen3-8B does not): `output.weight` is
optional, and without it the embedding is the lm_head.

Adding a family (a Gemma, a Mistral): one `Family` record in `FAMILIES`, keyed by its
`general.architecture`, built from the tables below or its own; an op in ops.py only if
it computes something the others do not (then its one reader in model.py).
tests/test_families.py registers a toy family from its test file and runs a synthetic
model of it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class TensorSpec:
    """One GGUF tensor: its role in the engine, its name, its shape from the config.

    `dims` names `Config` attributes, outermost first: `(n,)` for a vector (a norm),
    `(n_out, n_in)` for a matrix, `(experts, n_out, n_in)` for a stack of expert
    matrices.  (A GGUF file lists shapes innermost first: `ggml_shape`.)
    """

    role: str                     # the engine's name for it (weights.py, model.py)
    name: str                     # GGUF name; a layer's tensors are "blk.{i}." + name
    dims: tuple[str, ...]         # Config attributes, outermost first
    bias: str | None = None       # the GGUF name of its bias (dims[0] values), if any
    optional: bool = False        # may be absent (the lm_head of a tied model)
    float32: bool = False         # written as F32 whatever the model's format (router)

    def shape(self, cfg) -> tuple[int, ...]:
        """The shape for `cfg`, outermost first: `[n_out, n_in]` for a matrix."""
        return tuple(getattr(cfg, d) for d in self.dims)

    def ggml_shape(self, cfg) -> tuple[int, ...]:
        """The shape as a GGUF file stores it: the innermost (contiguous) first."""
        return self.shape(cfg)[::-1]


def _norm(role: str, name: str, dim: str = "hidden_size") -> TensorSpec:
    return TensorSpec(role, f"{name}.weight", (dim,))


def _matrix(role: str, name: str, n_out: str, n_in: str, bias: bool = False,
            **kw) -> TensorSpec:
    return TensorSpec(role, f"{name}.weight", (n_out, n_in),
                      bias=f"{name}.bias" if bias else None, **kw)


def _experts(role: str, name: str, n_out: str, n_in: str) -> TensorSpec:
    return TensorSpec(role, f"{name}.weight", ("num_experts", n_out, n_in))


# The tensors outside the layers, in the order files list them.
MODEL_TENSORS = (
    _matrix("embedding", "token_embd", "vocab_size", "hidden_size"),
    _norm("final_norm", "output_norm"),
    _matrix("lm_head", "output", "vocab_size", "hidden_size",
            optional=True),
)


@dataclass(frozen=True)
class Family:
    arch: str                 # the GGUF's `general.architecture`
    rope_style: str           # "neox": channel i pairs with i + d/2; "normal": 2i, 2i+1
    layer: tuple[TensorSpec, ...]  # one layer's tensors, in file order
    model: tuple[TensorSpec, ...] = MODEL_TENSORS  # the tensors outside the layers

    def has(self, role: str) -> bool:
        return any(t.role == role for t in self.layer)

    def tensor(self, role: str) -> TensorSpec:
        """The table's entry for `role` (a layer's or the model's)."""
        return next(t for t in self.model + self.layer if t.role == role)

    @property
    def embedding(self) -> TensorSpec:
        """The token embedding table (`[vocab, hidden]`: its rows count the vocabulary
        when the metadata does not)."""
        return self.tensor("embedding")

    @property
    def qk_norm(self) -> bool:
        """Per-head RMSNorm of q and k before RoPE."""
        return self.has("q_norm")

    @property
    def qkv_bias(self) -> bool:
        """The q/k/v projections add a bias."""
        return any(t.bias for t in self.layer if t.role in ("wq", "wk", "wv"))

    @property
    def moe(self) -> bool:
        """The FFN is a router and experts (moe.py) instead of one SwiGLU."""
        return self.has("router")

    def renamed(self, arch: str, **names: str) -> "Family":
        """This family under another architecture name, with some tensors renamed
        ({role: new GGUF name}): a near relative in one line."""
        layer = tuple(replace(t, name=names.get(t.role, t.name)) for t in self.layer)
        return replace(self, arch=arch, layer=layer)

    def __repr__(self) -> str:
        return (f"Family(arch={self.arch!r}, rope_style={self.rope_style!r}, "
                f"qk_norm={self.qk_norm}, qkv_bias={self.qkv_bias}, moe={self.moe})")


def _attention(bias: bool) -> tuple[TensorSpec, ...]:
    """The attention half of a layer: its norm, the q/k/v projections (+ bias), the
    output projection."""
    return (_norm("attention_norm", "attn_norm"),
            _matrix("wq", "attn_q", "q_dim", "hidden_size", bias),
            _matrix("wk", "attn_k", "kv_dim", "hidden_size", bias),
            _matrix("wv", "attn_v", "kv_dim", "hidden_size", bias),
            _matrix("wo", "attn_output", "hidden_size", "q_dim"))


QK_NORM = (_norm("q_norm", "attn_q_norm", "head_dim"),     # per head, before RoPE
           _norm("k_norm", "attn_k_norm", "head_dim"))
DENSE_FFN = (_norm("feed_forward_norm", "ffn_norm"),
             _matrix("w_gate", "ffn_gate", "intermediate_size", "hidden_size"),
             _matrix("w_up", "ffn_up", "intermediate_size", "hidden_size"),
             _matrix("w_down", "ffn_down", "hidden_size", "intermediate_size"))
MOE_FFN = (_norm("feed_forward_norm", "ffn_norm"),
           _matrix("router", "ffn_gate_inp", "num_experts", "hidden_size",
                   float32=True),
           _experts("experts_gate", "ffn_gate_exps", "moe_intermediate_size",
                    "hidden_size"),
           _experts("experts_up", "ffn_up_exps", "moe_intermediate_size",
                    "hidden_size"),
           _experts("experts_down", "ffn_down_exps", "hidden_size",
                    "moe_intermediate_size"))


FAMILIES: dict[str, Family] = {f.arch: f for f in (
    Family("qwen3", "neox", layer=_attention(bias=False) + QK_NORM + DENSE_FFN),
    Family("qwen3moe", "neox", layer=_attention(bias=False) + QK_NORM + MOE_FFN),
    Family("qwen2", "neox", layer=_attention(bias=True) + DENSE_FFN),
    Family("llama", "normal", layer=_attention(bias=False) + DENSE_FFN),
)}
