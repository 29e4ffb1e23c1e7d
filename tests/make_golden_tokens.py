"""Regenerate the tokenizer golden files from llama.cpp (the independent oracle).

    python tests/make_golden_tokens.py

For each vocabulary it asks llama.cpp (`llama_cpp.Llama(path, vocab_only=True).tokenize`) for the ids
of every corpus string and of the seeded random strings, with and without special-token parsing,
and writes `tests/data/golden_tokens_<name>.json.gz`.  The test suite compares the engine against
these files, so parity is still checked on a machine without llama.cpp; where llama.cpp is
installed the tests also compare live.
"""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from tokenizer_cases import CORPUS, MALFORMED, random_strings  # noqa: E402

N_RANDOM = 5000
RANDOM_SEED = 1234


def vocab_paths() -> dict[str, Path]:
    from fucina_course import catalog

    return {
        "qwen3-vocab": catalog.qwen3_vocab_path(),
        "qwen2.5-coder-0.5b": catalog.fetch("qwen2.5-coder-0.5b"),
        "smollm2-135m": catalog.fetch("smollm2-135m"),
    }


def llama_vocab(path: Path):
    import llama_cpp

    return llama_cpp.Llama(str(path), vocab_only=True, verbose=False)


def oracle_ids(llm, data: bytes, special: bool) -> list[int]:
    return llm.tokenize(data, add_bos=False, special=special)


def main() -> None:
    import llama_cpp

    for name, path in vocab_paths().items():
        llm = llama_vocab(path)
        record = {
            "oracle": f"llama-cpp-python {llama_cpp.__version__}",
            "vocab": name,
            "random_seed": RANDOM_SEED,
            "cases": [{"text": t, "special": oracle_ids(llm, t.encode(), True),
                       "plain": oracle_ids(llm, t.encode(), False)} for t in CORPUS],
            "malformed": [{"hex": b.hex(), "ids": oracle_ids(llm, b, True)} for b in MALFORMED],
            "random": [{"text": t, "special": oracle_ids(llm, t.encode("utf-8", "surrogatepass"), True),
                        "plain": oracle_ids(llm, t.encode("utf-8", "surrogatepass"), False)}
                       for t in random_strings(N_RANDOM, RANDOM_SEED)],
        }
        out = HERE / "data" / f"golden_tokens_{name}.json.gz"
        with gzip.open(out, "wt", encoding="utf-8") as f:
            json.dump(record, f, ensure_ascii=False, separators=(",", ":"))
        print(f"{out}: {len(record['cases'])} corpus cases, {len(record['random'])} random strings")


if __name__ == "__main__":
    main()
