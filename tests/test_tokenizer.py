"""Behaviour of the tokenizer's pieces, pinned one rule at a time (parity with llama.cpp
on whole strings lives in test_tokenizer_parity.py)."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import regex

from conftest import tokenizer_for
from fucina_course import Tokenizer, TokenizerError, TokenType
from fucina_course import pretokenizer as pre
from fucina_course.bpe import bpe_merge
from fucina_course.tokenizer import (BYTE_TO_CHAR, CHAR_TO_BYTE, map_bytes,
                                     unmap_token_text)
from fucina_course.utf8 import decode_utf8_like_llama
from tokenizer_cases import RUN_UNITS, long_run, random_strings


@pytest.fixture(scope="module")
def qwen(qwen3_vocab_path):
    return tokenizer_for(qwen3_vocab_path)


# --- the GPT-2 byte map ---------------------------------------------------------------

def test_byte_map_round_trips_all_256_bytes():
    assert len(set(BYTE_TO_CHAR.values())) == 256
    assert all(CHAR_TO_BYTE[BYTE_TO_CHAR[b]] == b for b in range(256))
    assert BYTE_TO_CHAR[0x20] == "Ġ" and BYTE_TO_CHAR[0x0A] == "Ċ"
    assert BYTE_TO_CHAR[ord("A")] == "A"
    everything = bytes(range(256))
    assert unmap_token_text(map_bytes(everything)) == everything


# --- the Qwen2 pretokenizer rules -----------------------------------------------------

@pytest.mark.parametrize("text,chunks", [
    ("1234567", ["1", "2", "3", "4", "5", "6", "7"]),  # \p{N} has no quantifier
    ("3.14", ["3", ".", "1", "4"]),
    ("١٢٣", ["١", "٢", "٣"]),                          # Arabic-Indic digits are \p{N}
    ("Hello!\n\nWorld", ["Hello", "!\n\n", "World"]),  # punctuation absorbs newlines
    ("hello     world", ["hello", "    ", " world"]),  # the run donates its last space
    ("I'LL go", ["I", "'LL", " go"]),                  # contractions in any case
    ("l'\u017fa", ["l", "'\u017fa"]),                  # ...but ASCII-only folding
    ("a\r\n\r\nb", ["a", "\r\n\r\n", "b"]),
    ("x  \n  y", ["x", "  \n", " ", " y"]),
    ("I'll pay 42 euros!\n", ["I", "'ll", " pay", " ", "4", "2", " euros", "!\n"]),
])
def test_qwen2_chunks(text, chunks):
    assert pre.QWEN2.split(text) == chunks


def test_llama3_groups_digits_by_three_and_gpt2_takes_runs():
    assert pre.LLAMA3.split("1234567") == ["123", "456", "7"]
    assert pre.GPT2.split("abc 1234567") == ["abc", " 1234567"]
    assert pre.SMOLLM.split("a 12") == ["a", " ", "1", "2"]


def test_whitespace_is_unicode_white_space_not_python_isspace():
    # 0x1C..0x1F are whitespace to Python's str.isspace, but not to llama.cpp (nor to
    # Unicode).
    assert pre.QWEN2.split("a\x1c b") == ["a", "\x1c", " b"]
    assert pre.QWEN2.split("a\u3000\u3000b") == ["a", "\u3000", "\u3000b"]


UPSTREAM_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                  r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def test_collapse_trick_agrees_with_an_independent_regex_engine():
    """The upstream pattern, run by the `regex` module on the real text (no collapsing),
    gives the same chunks, except where the two intentionally differ (0x1C-0x1F and
    U+017F, excluded here)."""
    rx = regex.compile(UPSTREAM_QWEN2)
    checked = 0
    for text in random_strings(3000, seed=99):
        if any(c in text for c in "\x1c\x1d\x1e\x1f\u017f"):
            continue
        assert pre.QWEN2.split(text) == rx.findall(text), repr(text)
        checked += 1
    assert checked > 2500


def test_long_runs_split_as_the_regex_module_splits_them():
    """Runs of each character class, long enough that a rescan per position would
    show, give the upstream pattern's chunks (see the pretokenizer's docstring for its
    cost)."""
    rx = regex.compile(UPSTREAM_QWEN2)
    for unit in [*RUN_UNITS.values(), " \n", "\u3000", "'s", "e\u0301"]:
        for tail in ("", "x", " "):
            text = long_run(unit, 5000) + tail
            assert pre.QWEN2.split(text) == rx.findall(text), (unit, tail)


def test_collapse_keeps_length_and_classes():
    text = "aé日1١ \u3000😀"
    c = pre.collapse(text)
    assert len(c) == len(text)
    assert c == ("a" + pre.LETTER + pre.LETTER + "1" + pre.NUMBER + " " + pre.SPACE
                 + pre.OTHER)


# --- special markers ------------------------------------------------------------------

def test_markers_are_single_ids(qwen):
    im_end = qwen.token_id("<|im_end|>")
    assert qwen.encode_raw("<|im_end|>") == [im_end] == [151645]
    assert qwen.encode_raw("<|im_start|><|im_end|>") == [151644, 151645]
    # with special=False a control marker is plain text...
    assert len(qwen.encode_raw("<|im_end|>", special=False)) > 1
    # ...but a user-defined one (<think>) is still cut out, as llama.cpp does
    assert qwen.encode_raw("<think>", special=False) == [151667]


def test_broken_markers_are_text(qwen):
    for text in ["<|im_", "<|im_start", "<|unknown|>", "<||>"]:
        ids = qwen.encode_raw(text)
        assert not any(qwen.is_special(i) for i in ids), text
        assert qwen.decode(ids) == text


def test_without_token_types_angle_bar_entries_are_markers():
    tok = Tokenizer.from_parts(["<|im_end|>", "h", "i", "hi", "<", "|"], ["h i"],
                               pre="qwen2")
    assert tok.encode_raw("hi<|im_end|>") == [3, 0]
    assert tok.decode([3, 0]) == "hi<|im_end|>"
    assert tok.encode_raw("<|") == [4, 5]


def test_merge_result_missing_from_vocab_falls_back_to_bytes():
    tok = Tokenizer.from_parts(["a", "b", "c"], ["a b"], [TokenType.NORMAL] * 3,
                               pre="qwen2")
    assert tok.bpe(b"abc") == [b"ab", b"c"]
    assert tok.encode_raw("abc") == [0, 1, 2]


def test_bpe_merges_lowest_rank_first_leftmost_on_ties():
    toks = ["a", "b", "ab", "aa", "aaa"]
    tok = Tokenizer.from_parts(toks, ["a b", "a a", "aa a"], [TokenType.NORMAL] * 5,
                               pre="gpt2")
    assert tok.bpe(b"aab") == [b"a", b"ab"]       # "a b" (rank 0) beats "a a" (rank 1)
    # leftmost "a a" first; then the remaining "a a" (rank 1) beats "aa a" (rank 2)
    assert tok.bpe(b"aaaa") == [b"aa", b"aa"]
    assert tok.bpe(b"aaa") == [b"aaa"]


def test_unknown_pretokenizer_warns_once_and_uses_qwen2(caplog):
    with caplog.at_level(logging.WARNING):
        tok = Tokenizer.from_parts(["a", "1", "2"], [], pre="some-new-model")
    assert tok.pre_mismatch == "some-new-model"
    assert tok.pretokenizer is pre.QWEN2
    assert sum("some-new-model" in r.message for r in caplog.records) == 1


def test_bos_policy():
    qwen_like = Tokenizer.from_parts(["a", "<|endoftext|>"], [], pre="qwen2", bos_id=1,
                                     eos_id=1)
    assert qwen_like.encode("a") == [0]
    llama3_like = Tokenizer.from_parts(["a", "<|begin_of_text|>"], [], pre="llama3",
                                       bos_id=1)
    assert llama3_like.add_bos and llama3_like.encode("a") == [1, 0]
    assert llama3_like.encode_raw("a") == [0]


# --- decoding and streaming -----------------------------------------------------------

def test_stream_decoder_never_emits_half_a_character(qwen):
    text = "Party 🫠🪩 time 👨‍👩‍👧 ok"
    ids = qwen.encode_raw(text)
    # some character spans several ids
    assert len(ids) > len(qwen.pretokenizer.split(text))
    naive = [qwen.decode([i]) for i in ids]
    assert any("\ufffd" in piece for piece in naive)       # the problem is real...
    stream = qwen.stream()
    pieces = [stream.push(i) for i in ids] + [stream.flush()]
    assert all("\ufffd" not in p for p in pieces)         # ...and the stream solves it
    assert "".join(pieces) == text


def test_stream_flush_releases_an_incomplete_tail(qwen):
    ids = qwen.encode_raw("ok 🫠")
    assert len(qwen.decode_bytes(ids[-1:])) < 4  # the emoji's 4 bytes span some ids
    ids = ids[:-1]                               # so dropping the last cuts it short
    stream = qwen.stream()
    out = "".join(stream.push(i) for i in ids)
    assert out == "ok "
    assert stream.flush() == "\ufffd"


def test_decode_rejects_ids_outside_the_vocabulary(qwen):
    with pytest.raises(TokenizerError):
        qwen.decode([qwen.vocab_size])
    with pytest.raises(TokenizerError):
        qwen.decode([-1])


def test_skip_special(qwen):
    ids = qwen.encode_raw("<|im_start|>hi<|im_end|>")
    assert qwen.decode(ids, skip_special=True) == "hi"


def test_lenient_utf8_decoding_matches_llama_rules():
    assert decode_utf8_like_llama(b"a\xffb") == "a\ufffdb"
    assert decode_utf8_like_llama(b"\xc0\x80") == "\x00"  # overlong NUL: U+0000
    assert decode_utf8_like_llama(b"\xed\xa0\x80") == "\ud800"  # a surrogate, as is
    # cut short: one U+FFFD per byte
    assert decode_utf8_like_llama(b"\xe4\xb8") == "\ufffd\ufffd"
    # beyond U+10FFFF: llama.cpp aborts the process (so no live comparison); we read one
    # U+FFFD
    assert decode_utf8_like_llama(b"a\xf4\x90\x80\x80b") == "a\ufffdb"


def test_long_mixed_text_encodes_into_the_vocabulary(qwen):
    """50k characters of mixed text in one call (speed: bench/bench_tokenize.py)."""
    text = " ".join(random_strings(2000, seed=5))
    ids = qwen.encode_raw(text)
    assert len(ids) > 10_000
    assert np.all(np.asarray(ids) < qwen.vocab_size)
    assert qwen.decode(ids) == text


# --- BPE cost: O(n log n) work, the old loop's merges, a cap -------------------------

def _old_bpe(chunk: bytes, ranks: dict) -> tuple[list[bytes], int]:
    """The oracle: the rule as the engine ran it before the heap (issue 42).  Fuse the
    lowest-rank pair, leftmost on ties, found by `min` + `index` over a list of pair
    ranks.  Also returns its work: the pair ranks those scans and the splice touch,
    summed over the merges, O(n) a merge."""
    parts = [chunk[i:i + 1] for i in range(len(chunk))]
    none = float("inf")
    rank_of = [ranks.get(pair, none) for pair in zip(parts, parts[1:])]
    work = len(rank_of)
    while rank_of and min(rank_of) != none:
        work += len(rank_of)
        i = rank_of.index(min(rank_of))
        parts[i:i + 2] = [parts[i] + parts[i + 1]]
        del rank_of[i]
        if i > 0:
            rank_of[i - 1] = ranks.get((parts[i - 1], parts[i]), none)
        if i < len(rank_of):
            rank_of[i] = ranks.get((parts[i], parts[i + 1]), none)
    return parts, work


def test_bpe_merge_equals_the_old_rule_on_random_chunks(qwen):
    """Real chunks of random mixed text, random runs over small alphabets (long merges,
    many ties) and random bytes that are not UTF-8, with Qwen's 151k merges."""
    rng = np.random.default_rng(7)
    chunks = [c.encode("utf-8", "surrogatepass") for text in random_strings(800, seed=8)
              for c in qwen.pretokenizer.split(text)]
    for _ in range(600):
        alphabet = ["a", "ab", " ", " \t\n", "-=", "日本", "e\u0301", "xyz "][
            int(rng.integers(8))]
        chunks.append("".join(rng.choice(list(alphabet), size=int(rng.integers(1, 400)))
                              ).encode())
    chunks += [bytes(rng.integers(256, size=int(rng.integers(1, 200))).tolist())
               for _ in range(300)]
    for chunk in chunks:
        assert bpe_merge(chunk, qwen.ranks)[0] == _old_bpe(chunk, qwen.ranks)[0], chunk


@pytest.mark.parametrize("seed", range(6))
def test_bpe_merge_equals_the_old_rule_on_scrambled_ranks(seed):
    """Merge tables no trained vocabulary has: ranks in random order (a merge's result
    can outrank its own parts, so a new pair can be the next merge at once), and with
    seeds 3-5 one rank shared by several pairs (the leftmost of them must go first)."""
    rng = np.random.default_rng(seed)
    tokens, pairs = [b"a", b"b", b"c"], []
    while len(pairs) < 40:
        a, b = (tokens[int(i)] for i in rng.integers(len(tokens), size=2))
        if (a, b) not in pairs and len(a + b) <= 6:
            pairs.append((a, b))
            tokens.append(a + b)
    values = (rng.permutation(len(pairs)) if seed < 3
              else rng.integers(len(pairs) // 4, size=len(pairs)))
    ranks = dict(zip(pairs, values.tolist()))
    for _ in range(300):
        chunk = bytes(rng.choice(list(b"abc"), size=int(rng.integers(1, 120))).tolist())
        assert bpe_merge(chunk, ranks)[0] == _old_bpe(chunk, ranks)[0], chunk


def test_bpe_merge_on_both_sides_of_the_shared_links():
    """Chunks up to len(_LINKS) - 2 bytes link their parts by slicing one shared list,
    longer ones build their own: both give the old rule's parts."""
    from fucina_course.bpe import _LINKS

    toks = ["a", "b", "ab", "abab", "ba"]
    tok = Tokenizer.from_parts(toks, ["a b", "ab ab", "b a"], [TokenType.NORMAL] * 5)
    edge = len(_LINKS) - 2
    for n in (edge - 1, edge, edge + 1, edge + 3):
        chunk = (b"ab" * n)[:n]
        assert bpe_merge(chunk, tok.ranks)[0] == _old_bpe(chunk, tok.ranks)[0], n


# name -> the unit repeated to make one chunk: letters, spaces, digits, punctuation,
# "ab" alternating, CJK, newlines, tabs
_GROWTH_UNITS = {"letters": "a", "spaces": " ", "digits": "7", "dashes": "-",
                 "ab": "ab", "CJK": "日", "newlines": "\n", "tabs": "\t"}


@pytest.mark.parametrize("unit", _GROWTH_UNITS.values(), ids=_GROWTH_UNITS.keys())
def test_bpe_work_grows_linearly_with_the_run(qwen, unit):
    """4x the bytes of one run costs at most 4.5x the steps (heap keys popped, plus the
    bytes), counted rather than timed.  The same measure on the old loop (its work,
    4x from 1,000 bytes, kept small because it is slow) grows ~16x wherever the run
    merges, which is what made 20,000 x "a" take 2.7 s: this test fails on it.  Qwen
    has no merge of two digits, so on "7777..." both are linear."""
    def run(n):
        return (unit * n).encode()[:n]

    parts, steps = bpe_merge(run(5000), qwen.ranks)
    steps_4x = bpe_merge(run(20000), qwen.ranks)[1]
    assert steps_4x <= 4.5 * steps, (steps, steps_4x)
    work, work_4x = (_old_bpe(run(n), qwen.ranks)[1] for n in (1000, 4000))
    merges = 5000 - len(parts)
    assert work_4x > 12 * work or merges == 0, (work, work_4x)


def test_bpe_steps_are_bounded_by_four_per_byte(qwen):
    """Each merge pushes at most two keys, so a chunk of n bytes pops at most 3n keys
    and takes at most 4n steps: the bound the cap's timing rests on (spaces come
    closest, ~3.95n)."""
    for unit in _GROWTH_UNITS.values():
        chunk = (unit * 5000).encode()[:5000]
        assert bpe_merge(chunk, qwen.ranks)[1] <= 4 * len(chunk)


def test_a_chunk_over_the_cap_is_a_one_line_error(qwen, monkeypatch):
    from fucina_course import bpe

    cap = bpe.MAX_CHUNK_BYTES
    with pytest.raises(TokenizerError) as err:
        qwen.encode_raw("a" * (cap + 1))
    message = str(err.value)
    assert "\n" not in message
    assert f"chunk of {cap + 1:,} bytes" in message
    assert f"MAX_CHUNK_BYTES ({cap:,})" in message
    # A lower cap, to see both sides of it cheaply: the cap is per chunk, not per text.
    monkeypatch.setattr(bpe, "MAX_CHUNK_BYTES", 1000)
    assert bpe_merge(b"a" * 1000, qwen.ranks)[0] == _old_bpe(b"a" * 1000, qwen.ranks)[0]
    with pytest.raises(TokenizerError, match="chunk of 1,001 bytes"):
        qwen.bpe(b" " * 1001)
    text = "ab " * 2000                            # 6,000 bytes in 2,001 chunks
    assert qwen.decode(qwen.encode_raw(text)) == text


def test_only_short_chunks_are_cached(qwen):
    from fucina_course.tokenizer import CACHE_CHUNK_BYTES

    qwen._cache.clear()
    long_word = "x" * (CACHE_CHUNK_BYTES + 1)
    ids = qwen.encode_raw(long_word + " hello")
    assert list(qwen._cache) == [b" hello"]
    assert qwen.encode_raw(long_word + " hello") == ids


def test_thousands_of_markers(qwen):
    start = qwen.token_id("<|im_start|>")
    assert qwen.encode_raw("<|im_start|>" * 5000) == [start] * 5000
    ids = qwen.encode_raw("<|im_start|>a" * 3000)
    assert ids == [start, qwen.id_of[b"a"]] * 3000


# --- a malformed vocabulary is a TokenizerError naming the entry ----------------------

ABC = ["a", "b", "c", "ab"]


def test_byte_tokens_must_spell_one_byte():
    for spelling in ["<0x", "<0xG1>", "<0x41", "<0x4142>", "<0x>", "xy"]:
        types = [TokenType.NORMAL] * 4 + [TokenType.BYTE]
        with pytest.raises(TokenizerError, match="token 4 .* typed BYTE"):
            Tokenizer.from_parts(ABC + [spelling], ["a b"], types)
    tok = Tokenizer.from_parts(ABC + ["<0x41>", "Ċ"], ["a b"],
                               [TokenType.NORMAL] * 4 + [TokenType.BYTE] * 2)
    assert tok.token_to_bytes(4) == b"A" and tok.token_to_bytes(5) == b"\n"


def test_merges_must_name_two_tokens_of_the_vocabulary():
    with pytest.raises(TokenizerError, match="merge #1 'a z' names a token that is"):
        Tokenizer.from_parts(ABC, ["a b", "a z"], [TokenType.NORMAL] * 4)
    with pytest.raises(TokenizerError, match="merge #0 'ab' is not two tokens"):
        Tokenizer.from_parts(ABC, ["ab"], [TokenType.NORMAL] * 4)


@pytest.mark.parametrize("types, match", [
    ([1, 1, 1], "4 tokens but 3 token types"),
    ([1, 1, 1, 1, 1], "4 tokens but 5 token types"),
    ([1, 1, 7, 1], "token 2 \\('c'\\) has type 7; token types are 0-6"),
    ([1, -1, 1, 1], "token 1 \\('b'\\) has type -1"),
    ([1, 1, 1, 2**40], "token 3 \\('ab'\\) has type 1099511627776"),
    (np.array([1, 1, 1, 2**32 - 1], dtype=np.uint32), "has type 4294967295"),
    (np.array([1.0, 1.0, 1.0, 1.0]), "token types should be integers"),
])
def test_token_types_in_range_and_one_per_token(types, match):
    with pytest.raises(TokenizerError, match=match):
        Tokenizer.from_parts(ABC, ["a b"], types)


@pytest.mark.parametrize("ids, match", [
    (dict(bos_id=4), "BOS token id 4 is outside the vocabulary \\(4 tokens\\)"),
    (dict(eos_id=-1), "EOS token id -1"),
    (dict(eot_ids=(1, 2**32 - 1)), "end-of-turn token id 4294967295"),
])
def test_special_ids_inside_the_vocabulary(ids, match):
    with pytest.raises(TokenizerError, match=match):
        Tokenizer.from_parts(ABC, ["a b"], [TokenType.NORMAL] * 4, **ids)


def test_empty_and_oversized_vocabularies():
    with pytest.raises(TokenizerError, match="the vocabulary is empty"):
        Tokenizer.from_parts([], [], [])
    from fucina_course.tokenizer import MAX_VOCAB

    with pytest.raises(TokenizerError, match="more than the 2,097,152"):
        Tokenizer.from_parts(ABC, ["a b"] * (MAX_VOCAB + 1), [TokenType.NORMAL] * 4)


def test_from_gguf_errors_name_the_file(tmp_path, monkeypatch):
    from gguf_fuzz import ARR, I32, KV, STR, U32, Doc, serialize

    from fucina_course import GGUFFile

    kvs = [KV(b"general.architecture", STR, b"qwen3"),
           KV(b"tokenizer.ggml.model", STR, b"gpt2"),
           KV(b"tokenizer.ggml.tokens", ARR, [t.encode() for t in ABC], STR),
           KV(b"tokenizer.ggml.token_type", ARR, [1, 1, 1, 1], I32),
           KV(b"tokenizer.ggml.merges", ARR, [b"a b"], STR),
           KV(b"tokenizer.ggml.eos_token_id", U32, 9)]
    path = tmp_path / "vocab.gguf"
    path.write_bytes(serialize(Doc(3, kvs, [], 32, b""))[0])
    with pytest.raises(TokenizerError, match=r"vocab\.gguf: the EOS token id 9 is out"):
        Tokenizer.from_gguf(GGUFFile(path))
    # The size limit is checked before a single token string is built.
    from fucina_course import tokenizer

    monkeypatch.setattr(tokenizer, "MAX_VOCAB", 3)
    match = "'tokenizer.ggml.tokens' holds 4 entries; at most 3 are accepted"
    with pytest.raises(TokenizerError, match=match):
        Tokenizer.from_gguf(GGUFFile(path))


def test_a_repeated_merge_keeps_its_first_rank():
    tok = Tokenizer.from_parts(ABC, ["a b", "b c", "a b"], [TokenType.NORMAL] * 4)
    assert tok.ranks == {(b"a", b"b"): 0, (b"b", b"c"): 1}
    assert list(tok.ranks) == [(b"a", b"b"), (b"b", b"c")]  # rank order


def test_unmap_many_equals_one_at_a_time():
    from fucina_course.tokenizer import unmap_many

    texts = ["ĠHello", "", "Ċ", "日本", "abc", "Ġ", "\u0100x"]
    assert unmap_many(texts) == [unmap_token_text(t) for t in texts]
    assert unmap_many(texts[2:3] + ["ok"]) == [b"\n", b"ok"]


# --- the built tables' disk cache -----------------------------------------------------

_CACHE_PROBES = ["What is the capital of France?", "<|im_start|>user\nhi<|im_end|>",
                 " \u00e9t\u00e9  1234567 \u4f60\u597d 'll 'LL\n\n\t x",
                 "\U0001f600<think>"]


def _tables(tok):
    return (tok.tokens, tok.merges, tok.token_types.tolist(), tok.token_bytes,
            tok.id_of, tok.ranks, tok.special_markers, tok.pretokenizer, tok.bos_id,
            tok.eos_id, tok.add_bos, tok.add_eos, tok.eot_ids, tok.chat_template)


def test_a_cached_tokenizer_is_the_built_one(coder_path, tmp_path, monkeypatch):
    from fucina_course import GGUFFile
    from fucina_course import tokenizer as tk

    gguf = GGUFFile(coder_path)
    built = Tokenizer.from_gguf(gguf, cache_dir=tmp_path)  # a miss: built, then saved
    saved = list((tmp_path / "tokenizers").glob("*.pickle"))
    assert len(saved) == 1
    calls = []
    monkeypatch.setattr(tk.Tokenizer, "from_parts",
                        classmethod(lambda cls, *a, **k: calls.append(1)))
    cached = Tokenizer.from_gguf(gguf, cache_dir=tmp_path)  # a hit: nothing is built
    assert calls == [] and cached is not built
    assert _tables(cached) == _tables(built)
    for text in _CACHE_PROBES + random_strings(200):
        assert cached.encode(text) == built.encode(text)


def test_the_cache_key_is_the_vocabulary_and_the_code(coder_path, monkeypatch):
    from fucina_course import GGUFFile
    from fucina_course import tokenizer_cache as tk

    gguf = GGUFFile(coder_path)
    types = gguf.get_array("tokenizer.ggml.token_type")
    params = dict(pre="qwen2", bos_id=None, eos_id=151643, add_bos=False, add_eos=False,
                  chat_template=None, eot_ids=(151643,))
    key = tk.tables_key(gguf, types, params)
    assert key == tk.tables_key(gguf, types.copy(), dict(params))
    assert key != tk.tables_key(gguf, types, {**params, "eos_id": 151645})
    changed = types.copy()
    changed[100] = TokenType.CONTROL
    assert key != tk.tables_key(gguf, changed, params)
    real_open = open

    def edited_source(path, *args, **kwargs):            # tokenizer.py, one byte more
        f = real_open(path, *args, **kwargs)
        if str(path).endswith("tokenizer.py"):
            import io
            return io.BytesIO(f.read() + b"#")
        return f
    monkeypatch.setattr("builtins.open", edited_source)
    tk._code_stamp.cache_clear()                         # read once per process
    try:
        assert key != tk.tables_key(gguf, types, params)
    finally:
        monkeypatch.undo()
        tk._code_stamp.cache_clear()


def test_a_broken_cache_entry_is_built_again(coder_path, tmp_path):
    from fucina_course import GGUFFile

    gguf = GGUFFile(coder_path)
    built = Tokenizer.from_gguf(gguf, cache_dir=tmp_path)
    (entry,) = (tmp_path / "tokenizers").glob("*.pickle")
    entry.write_bytes(b"not a pickle")
    again = Tokenizer.from_gguf(gguf, cache_dir=tmp_path)
    assert _tables(again) == _tables(built)
    assert entry.read_bytes() != b"not a pickle"          # and saved again


def test_small_vocabularies_are_not_cached(tmp_path):
    from fucina_course import GGUFFile
    from model_cases import tiny_model

    model = tiny_model("Q8_0", tmp_path)                  # 4,096 tokens
    Tokenizer.from_gguf(GGUFFile(model), cache_dir=tmp_path / "cache")
    assert not (tmp_path / "cache" / "tokenizers").exists()
