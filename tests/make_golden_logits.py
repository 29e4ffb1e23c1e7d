"""Regenerate tests/data/golden_logits.npz from llama.cpp (the independent oracle).

    python tests/make_golden_logits.py

For every block format, a tiny synthetic Qwen3 (seeded, so the test suite rebuilds the identical
file), and for three formats a tiny synthetic Qwen3-MoE, is evaluated by llama.cpp on a fixed id
sequence; the top-16 logits of every position are kept (and the full logit range, for
tolerances), with the file's SHA-256 so a changed generator is detected instead of silently
compared.
For the two real models, the chat prompt "What is the capital of France?" is evaluated (top-16
logits of every position) and llama.cpp's greedy 64-token continuation is recorded, with the top-16
logits each greedy choice was made from (to tell a near-tie from an error where the engines part).
"""

from __future__ import annotations

import hashlib
import sys
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from model_cases import (CHAT_QUESTION, FORMATS, MOE_FORMATS, N_GREEDY, TINY_IDS,  # noqa: E402
                         llama_all_logits, llama_greedy, tiny_model, tiny_moe_model, topk)


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def chat_prompt_ids(path: Path) -> list[int]:
    from fucina_course import GGUFFile, Tokenizer
    from fucina_course.chat import render_prompt

    tok = Tokenizer.from_gguf(GGUFFile(path))
    return tok.encode_raw(render_prompt(tok, CHAT_QUESTION))


def main() -> None:
    import llama_cpp

    from fucina_course import catalog

    out: dict[str, np.ndarray] = {"tiny_ids": np.array(TINY_IDS, np.int32)}
    with tempfile.TemporaryDirectory() as tmp:
        for fmt in FORMATS:
            path = tiny_model(fmt, Path(tmp))
            ref = llama_all_logits(llama_cpp, path, TINY_IDS)
            idx, val = topk(ref)
            out[f"tiny_{fmt}_range"] = np.float32(ref.max() - ref.min())
            out[f"tiny_{fmt}_sha256"] = np.array(sha256(path))
            out[f"tiny_{fmt}_top_ids"], out[f"tiny_{fmt}_top_vals"] = idx, val
            print(f"{fmt}: argmax {idx[:, 0].tolist()}")
        for fmt in MOE_FORMATS:
            path = tiny_moe_model(fmt, Path(tmp))
            ref = llama_all_logits(llama_cpp, path, TINY_IDS)
            idx, val = topk(ref)
            out[f"tiny_moe_{fmt}_range"] = np.float32(ref.max() - ref.min())
            out[f"tiny_moe_{fmt}_sha256"] = np.array(sha256(path))
            out[f"tiny_moe_{fmt}_top_ids"], out[f"tiny_moe_{fmt}_top_vals"] = idx, val
            print(f"moe {fmt}: argmax {idx[:, 0].tolist()}")
    for name in ("qwen2.5-coder-0.5b", "smollm2-135m"):
        path = catalog.fetch(name)
        ids = chat_prompt_ids(path)
        ref = llama_all_logits(llama_cpp, path, ids)
        idx, val = topk(ref)
        out[f"{name}_range"] = np.float32(ref.max() - ref.min())
        out[f"{name}_prompt_ids"] = np.array(ids, np.int32)
        out[f"{name}_top_ids"], out[f"{name}_top_vals"] = idx, val
        greedy, path_logits = llama_greedy(llama_cpp, path, ids, N_GREEDY, with_logits=True)
        out[f"{name}_greedy"] = np.array(greedy, np.int32)
        out[f"{name}_greedy_top_ids"], out[f"{name}_greedy_top_vals"] = topk(path_logits)
        print(f"{name}: greedy {out[f'{name}_greedy'].tolist()}")
    out["oracle"] = np.array(f"llama-cpp-python {llama_cpp.__version__}")
    np.savez_compressed(HERE / "data" / "golden_logits.npz", **out)
    print(f"wrote {HERE / 'data' / 'golden_logits.npz'}")


if __name__ == "__main__":
    main()
