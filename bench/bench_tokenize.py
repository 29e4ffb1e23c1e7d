"""Tokenizer speed on a 1 MB file: fucina vs llama.cpp vs HF `tokenizers`, same vocabulary.
Then on degenerate input: fucina vs llama.cpp.

    python bench/bench_tokenize.py [--json] [--runs-only] [--repeats N]

The text is built deterministically: Python standard-library sources (code, comments, docstrings)
up to 0.75 MB, plus 0.25 MB of the seeded multilingual random strings of the test suite.  Each
tokenizer encodes the whole file (no special-token parsing, no BOS); the figure is the best of 3
runs, after one warm-up.  The HF tokenizer is assembled from the same GGUF vocabulary and merges
(BPE model + the Qwen2 split regex + byte-level mapping), so all three see identical inputs.
The script also reports whether the three produced the same ids (HF's regex engine differs from
llama.cpp's on a few rare characters, e.g. U+2009 THIN SPACE runs, so its ids may differ slightly;
fucina's must equal llama.cpp's).

The degenerate table (issue 42): 20,000 repetitions of one character (a letter, a
space, a digit, a dash, a newline), each one pre-token chunk (digits: 20,000 one-digit
chunks), the input on which a BPE that rescans its pairs after every merge is
quadratic, plus 200 KB of English prose (the Python documentation's help topics,
`pydoc_data.topics`) as the ordinary case.  Both tokenizers get the same bytes
(special-token parsing on, no BOS); best of N after one warm-up; fucina's chunk cache
keeps no chunk over 64 bytes, so the long runs pay their BPE every time.  Acceptance:
within 10x of llama.cpp on the letters, spaces and digits, same ids.  `--runs-only`
skips the 1 MB table (and HF).
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


# name -> the degenerate text (issue 42's acceptance: letters, spaces, digits)
RUN_CHARS = {"20,000 x 'a'": "a", "20,000 spaces": " ", "20,000 x '7'": "7",
             "20,000 x '-'": "-", "20,000 newlines": "\n"}
PROSE_BYTES = 200_000


def degenerate_texts() -> dict[str, str]:
    import pydoc_data.topics

    topics = pydoc_data.topics.topics
    prose = "\n\n".join(topics[k] for k in sorted(topics)).encode()[:PROSE_BYTES]
    texts = {name: ch * 20_000 for name, ch in RUN_CHARS.items()}
    texts["200 KB of prose"] = prose.decode("utf-8", errors="ignore")
    return texts


def isa_level() -> str:
    """The x86-64 psABI level this CPU reaches (flags from /proc/cpuinfo), with its
    name; llama.cpp's tokenizer is scalar C++ and ours pure Python, so this says which
    machine, not which kernels."""
    from fucina_course.quant.isa import cpu_flags, cpu_name

    flags = cpu_flags()
    levels = [("x86-64-v4 (AVX-512)", "avx512f avx512bw avx512cd avx512dq avx512vl"),
              ("x86-64-v3 (AVX2)", "avx2 fma bmi1 bmi2 f16c movbe abm"),
              ("x86-64-v2", "sse4_2 ssse3 popcnt cx16")]
    level = next((name for name, need in levels if set(need.split()) <= flags),
                 platform.machine())
    return f"{level}, {cpu_name()}"


def degenerate_table(tok, llm, repeats: int) -> dict[str, dict]:
    rows = {}
    for name, text in degenerate_texts().items():
        data = text.encode()
        ours_s, ours = best_of(lambda: tok.encode_raw(data, special=True), repeats)
        theirs_s, theirs = best_of(
            lambda: llm.tokenize(data, add_bos=False, special=True), repeats)
        rows[name] = {"bytes": len(data), "n_tokens": len(ours), "fucina_s": ours_s,
                      "llama_cpp_s": theirs_s, "ratio": ours_s / theirs_s,
                      "same_ids": ours == theirs}
    return rows


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
    ap.add_argument("--runs-only", action="store_true",
                    help="only the degenerate-input table (no 1 MB file, no HF)")
    ap.add_argument("--repeats", type=int, default=5,
                    help="timed runs per degenerate row, after one warm-up (best kept)")
    args = ap.parse_args()

    import llama_cpp

    from fucina_course import GGUFFile
    from fucina_course.catalog import open_tokenizer, qwen3_vocab_path

    path = qwen3_vocab_path()
    rows = {}

    open_tokenizer(GGUFFile(path))          # builds and caches the tables once
    t = time.perf_counter()
    tok = open_tokenizer(GGUFFile(path))    # what a warm start pays: the cached tables
    load = time.perf_counter() - t
    t = time.perf_counter()
    llm = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    llm_load = time.perf_counter() - t
    report = {"machine": platform.processor() or platform.machine(), "isa": isa_level(),
              "python": platform.python_version()}

    if not args.runs_only:
        text = build_text()
        data = text.encode()
        tok._cache.clear()
        cold_t = time.perf_counter()
        ours = tok.encode_raw(data, special=False)
        cold = time.perf_counter() - cold_t
        warm, ours = best_of(lambda: tok.encode_raw(data, special=False))
        rows["fucina"] = {"load_s": load, "encode_cold_s": cold, "encode_warm_s": warm,
                          "n_tokens": len(ours)}

        secs, theirs = best_of(lambda: llm.tokenize(data, add_bos=False, special=False))
        rows["llama.cpp"] = {"load_s": llm_load, "encode_warm_s": secs,
                             "n_tokens": len(theirs), "same_ids": theirs == ours}

        t = time.perf_counter()
        hf = hf_tokenizer(tok)
        load = time.perf_counter() - t
        secs, enc = best_of(lambda: hf.encode(text, add_special_tokens=False).ids)
        rows["hf tokenizers"] = {"load_s": load, "encode_warm_s": secs,
                                 "n_tokens": len(enc), "same_ids": enc == ours}
        report.update(file_bytes=len(data), results=rows)

    runs = degenerate_table(tok, llm, args.repeats)
    report["degenerate"] = runs
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(f"machine: {report['isa']}; Python {report['python']}")
    if rows:
        print(f"{len(data):,} bytes -> {len(ours):,} tokens (Qwen vocabulary)")
    for name, r in rows.items():
        mb_s = len(data) / r["encode_warm_s"] / 1e6
        extra = f", cold {r['encode_cold_s']:.2f} s" if "encode_cold_s" in r else ""
        same = "" if "same_ids" not in r else f", same ids as fucina: {r['same_ids']}"
        print(f"{name:>14}: load {r['load_s']:.2f} s, encode "
              f"{r['encode_warm_s']:.3f} s ({mb_s:.1f} MB/s){extra}{same}")
    print(f"\ndegenerate input (Qwen vocabulary, best of {args.repeats} after a "
          "warm-up):")
    print(f"{'input':>18} {'bytes':>8} {'tokens':>7} {'fucina':>10} {'llama.cpp':>10} "
          f"{'ratio':>6}  same ids")
    for name, r in runs.items():
        print(f"{name:>18} {r['bytes']:>8,} {r['n_tokens']:>7,} "
              f"{r['fucina_s'] * 1e3:>7.1f} ms {r['llama_cpp_s'] * 1e3:>7.1f} ms "
              f"{r['ratio']:>5.1f}x  {'yes' if r['same_ids'] else 'NO'}")


if __name__ == "__main__":
    main()
