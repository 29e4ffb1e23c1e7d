"""Model families: what one architecture does differently from its relatives, one record
each.

The engine runs one transformer (model.py).  The families it loads share the GGUF tensor
names (llama.cpp's `token_embd`, `blk.N.attn_q`, ...) and the metadata keys (`<arch>.*`,
config.py) and differ in a few switches, each of which model.py reads in exactly one
place:

| family     | q/k norm | QKV bias | RoPE pairs              | FFN                |
|------------|----------|----------|-------------------------|--------------------|
| `qwen3`    | yes      | no       | "neox" (i with i + d/2) | dense SwiGLU       |
| `qwen3moe` | yes      | no       | "neox"                  | mixture of experts |
| `qwen2`    | no       | yes      | "neox"                  | dense SwiGLU       |
| `llama`    | no       | no       | "normal" (2i with 2i+1) | dense SwiGLU       |

Whether the output projection (lm_head) is tied to the embedding table is a property of
the file, not of the family (Qwen3-0.6B ties it, Qwen3-8B does not): model.py uses
`output.weight` when present and the embedding otherwise.

Adding a family (a Gemma, a Mistral): one `Family` record below, keyed by its
`general.architecture`; a new switch only if the family needs an op the others lack
(then the switch's one reader in model.py, and the op in ops.py).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    arch: str                 # the GGUF's `general.architecture`
    rope_style: str           # "neox": channel i pairs with i + d/2; "normal": 2i, 2i+1
    qk_norm: bool             # per-head RMSNorm of q and k before RoPE (attn_q/k_norm)
    qkv_bias: bool            # q/k/v projections add a bias (attn_{q,k,v}.bias)
    moe: bool = False         # FFN = router + experts (ffn_gate_inp, ffn_*_exps)


FAMILIES: dict[str, Family] = {f.arch: f for f in (
    Family("qwen3", rope_style="neox", qk_norm=True, qkv_bias=False),
    Family("qwen3moe", rope_style="neox", qk_norm=True, qkv_bias=False, moe=True),
    Family("qwen2", rope_style="neox", qk_norm=False, qkv_bias=True),
    Family("llama", rope_style="normal", qk_norm=False, qkv_bias=False),
)}
