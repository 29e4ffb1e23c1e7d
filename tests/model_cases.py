"""Models and inputs of the forward-pass parity tests, shared by the tests and the golden script."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from fucina_course.synth import TINY_QWEN3, TINY_QWEN3_MOE, with_format, write_synthetic

FORMATS = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"]
# max |ours - llama.cpp| allowed, as a fraction of the logit range (measured worst case in brackets,
# tiny synthetic Qwen3, 24 positions): float formats keep activations in float (F32 [1.2e-4],
# F16 [2.8e-4]); BF16 rounds activations to 8 mantissa bits [1.6e-3]; quantized formats quantize
# activations, which amplifies last-bit differences [Q4_K 1.0e-2, the worst].
TOLERANCE = {"F32": 1e-3, "F16": 1e-3, "BF16": 5e-3}
QUANTIZED_TOLERANCE = 2e-2
TOP_K = 16                               # golden files keep the top-16 logits of every position

# 24 ids inside the tiny models' 4096-entry vocabulary (fixed seed)
TINY_IDS = np.random.default_rng(42).integers(0, 4093, size=24).tolist()

CHAT_QUESTION = "What is the capital of France?"
N_GREEDY = 64


def tiny_model(fmt: str, directory: Path) -> Path:
    path = Path(directory) / f"tiny-qwen3-{fmt.lower()}.gguf"
    if not path.is_file():
        write_synthetic(with_format(TINY_QWEN3, fmt), path)
    return path


# Mixture of experts (tiny qwen3moe, 8 experts, 2 per token): a float, the 8-bit and a
# K-quant format, held to the dense model's tolerances above.
MOE_FORMATS = ["F32", "Q8_0", "Q4_K"]


def tiny_moe_model(fmt: str, directory: Path) -> Path:
    path = Path(directory) / f"tiny-qwen3-moe-{fmt.lower()}.gguf"
    if not path.is_file():
        write_synthetic(with_format(TINY_QWEN3_MOE, fmt), path)
    return path


def llama_all_logits(llama_cpp, path: Path, ids: list[int], threads: int = 2) -> np.ndarray:
    """llama.cpp's logits for every position of `ids` (one batch, fresh context, f16 KV cache)."""
    llm = llama_cpp.Llama(str(path), n_ctx=max(256, len(ids) + 8), n_batch=512, n_threads=threads,
                          logits_all=True, verbose=False)
    llm.eval(ids)
    return np.array(llm.scores[: len(ids)], dtype=np.float32)


def llama_greedy(llama_cpp, path: Path, prompt: list[int], n: int, threads: int = 2,
                 with_logits: bool = False):
    """Greedy continuation by llama.cpp: argmax of the last logits, one token at a time.

    With `with_logits`, also returns the `[n, vocab]` logits each choice was made from.
    """
    llm = llama_cpp.Llama(str(path), n_ctx=len(prompt) + n + 8, n_batch=512, n_threads=threads,
                          logits_all=True, verbose=False)  # llama-cpp-python keeps scores only with logits_all
    llm.eval(prompt)
    out, logits = [], []
    for _ in range(n):
        row = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
        tok = int(np.argmax(row))
        out.append(tok)
        logits.append(row)
        llm.eval([tok])
    return (out, np.stack(logits)) if with_logits else out


def argmax_disagreements(ours: np.ndarray, ref: np.ndarray, near_tie: float) -> list[int]:
    """Positions where the argmaxes differ although the reference's top two are more than
    `near_tie` apart (a flip between two candidates closer than that is a near-tie, not an error)."""
    ours, ref = np.atleast_2d(ours), np.atleast_2d(ref)
    bad = []
    for i in np.flatnonzero(ours.argmax(-1) != ref.argmax(-1)):
        if ref[i].max() - ref[i][ours[i].argmax()] > near_tie:
            bad.append(int(i))
    return bad


def tolerance(fmt: str) -> float:
    return TOLERANCE.get(fmt, QUANTIZED_TOLERANCE)


def topk(logits: np.ndarray, k: int = TOP_K) -> tuple[np.ndarray, np.ndarray]:
    idx = np.argsort(-logits, axis=-1)[..., :k]
    return idx.astype(np.int32), np.take_along_axis(logits, idx, axis=-1).astype(np.float32)
