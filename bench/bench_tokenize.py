"""Tokenizer speed on a 1 MB file: fucina vs llama.cpp vs HF `tokenizers`, same vocabulary.

    python bench/bench_tokenize.py [--json]

The text is built deterministically: Python standard-library sources (code, comments, docstrings)
up to 0.75 MB, plus 0.25 MB of the seeded multilingual random strings of the test suite.  Each
tokenizer encodes the whole file (no special-token parsing, no BOS); the figure is the best of 3
runs, after one warm-up.  The HF tokenizer is assembled from the same GGUF vocabulary and merges
(BPE model + the Qwen2 split regex + byte-level mapping), so all three see identical inputs.
The script also reports whether the three produced the same ids (HF's regex engine differs from
llama.cpp's on a few rare characters, e.g. U+2009 THIN SPACE runs, so its ids may differ slightly;
fucina's must equal llama.cpp's).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import sysconfig
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def build_text(size: int = 1_000_000) -> str:
    from tokenizer_cases import random_strings

    code_budget = size * 3 // 4
    parts, used = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        parts.append(text)
        used += len(text.encode())
        if used >= code_budget:
            break
    code = "".join(parts).encode()[:code_budget].decode("utf-8", errors="ignore")
    multi = "\n".join(random_strings(20_000, seed=2024)).encode()[: size - len(code.encode())]
    return code + multi.decode("utf-8", errors="ignore")


def hf_tokenizer(tok):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(tok.tokens) if tok.token_types[i] in (1, 6)}
    merges = [tuple(m.split(" ", 1)) for m in tok.merges]
    hf = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=False))
    hf.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    hf.decoder = decoders.ByteLevel()
    # user-defined markers (<think>, <tool_call>, ...) are cut out even without special parsing
    from tokenizers import AddedToken
    hf.add_tokens([AddedToken(tok.tokens[i], special=False, normalized=False)
                   for _, i, kind in tok.special_markers if kind == 4])
    return hf


def best_of(fn, repeats: int = 3) -> tuple[float, object]:
    result = fn()  # warm-up (also fills caches, as a long-running process would)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t)
    return min(times), result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    from fucina_course import GGUFFile
    from fucina_course.catalog import open_tokenizer, qwen3_vocab_path

    path = qwen3_vocab_path()
    text = build_text()
    data = text.encode()
    rows = {}

    open_tokenizer(GGUFFile(path))          # builds and caches the tables once
    t = time.perf_counter()
    tok = open_tokenizer(GGUFFile(path))    # what a warm start pays: the cached tables
    load = time.perf_counter() - t
    tok._cache.clear()
    cold_t = time.perf_counter()
    ours = tok.encode_raw(data, special=False)
    cold = time.perf_counter() - cold_t
    warm, ours = best_of(lambda: tok.encode_raw(data, special=False))
    rows["fucina"] = {"load_s": load, "encode_cold_s": cold, "encode_warm_s": warm, "n_tokens": len(ours)}

    import llama_cpp

    t = time.perf_counter()
    llm = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    load = time.perf_counter() - t
    secs, theirs = best_of(lambda: llm.tokenize(data, add_bos=False, special=False))
    rows["llama.cpp"] = {"load_s": load, "encode_warm_s": secs, "n_tokens": len(theirs),
                         "same_ids": theirs == ours}

    t = time.perf_counter()
    hf = hf_tokenizer(tok)
    load = time.perf_counter() - t
    secs, enc = best_of(lambda: hf.encode(text, add_special_tokens=False).ids)
    rows["hf tokenizers"] = {"load_s": load, "encode_warm_s": secs, "n_tokens": len(enc), "same_ids": enc == ours}

    report = {"file_bytes": len(data), "machine": platform.processor() or platform.machine(),
              "python": platform.python_version(), "results": rows}
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(f"{len(data):,} bytes -> {len(ours):,} tokens (Qwen vocabulary)")
    for name, r in rows.items():
        mb_s = len(data) / r["encode_warm_s"] / 1e6
        extra = f", cold {r['encode_cold_s']:.2f} s" if "encode_cold_s" in r else ""
        same = "" if "same_ids" not in r else f", same ids as fucina: {r['same_ids']}"
        print(f"{name:>14}: load {r['load_s']:.2f} s, encode {r['encode_warm_s']:.3f} s ({mb_s:.1f} MB/s){extra}{same}")


if __name__ == "__main__":
    main()
