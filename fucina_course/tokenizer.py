"""Byte-level BPE, built from the model file's own vocabulary and merge list.

The model never sees text: it sees integers below `vocab_size`.  This module turns
text into those integers and back, exactly as llama.cpp does for the same GGUF file (the
tests compare id for id).

The pipeline of `encode`, in order:

1. **Special markers.**  Tokens typed *control* or *user-defined* in
   `tokenizer.ggml.token_type` (`<|im_start|>`, `<think>`, ...) are cut out of the text
   first, longest marker first, and become one id each.  With `special=False` only the
   user-defined ones are cut (llama.cpp's rule: control markers typed by a user are
   plain text).  A `<|` that opens no known marker is ordinary text.
2. **Pretokenizer** (`pretokenizer.py`): each remaining fragment is split into
   word-like chunks.
3. **BPE** on each chunk's UTF-8 bytes: start from single bytes and repeatedly fuse the
   adjacent pair with the lowest merge rank (leftmost on ties) until no pair has a rank.
   `bpe_merge` (bpe.py) keeps the candidate pairs in a heap over a linked list of parts,
   so a chunk of n bytes costs O(n log n).  The rescanning loop it replaced was O(n^2),
   and long runs of one character class (indentation, a line of dashes, one letter
   pasted 200,000 times) are single chunks: 20,000 x "a" took 2.7 s (llama.cpp: 22 ms),
   now ~25 ms.  Rejected: keeping the old loop for short chunks behind a size threshold;
   on ordinary chunks (~6 bytes) the heap costs 2% more, not worth a second
   implementation (`bpe_merge` has the figures).  A chunk longer than `MAX_CHUNK_BYTES`
   (256 KiB, bpe.py) is refused with a `TokenizerError`, so no input holds the process
   for more than ~1 s a chunk.
4. **Lookup**: every surviving piece is a vocabulary entry; a piece that is not (only
   possible with an inconsistent vocabulary) falls back to its single-byte tokens.

Why "byte-level": the atoms are the 256 byte values, so no input is ever unknown.  The
vocabulary is stored as printable strings, so GPT-2 maps each byte to a printable
stand-in code point (`bytes_to_unicode`; a space is `Ġ`).  We translate the vocabulary
and the merges back to real bytes once, at load, and run BPE on bytes; the mapping is a
bijection, so the result is the same as merging stand-in strings.

Malformed UTF-8 (only possible when `encode` is given `bytes`) is decoded the way
llama.cpp decodes it: a byte that starts no valid sequence becomes U+FFFD, while
overlong forms and surrogates are accepted as the code points they spell.  With that,
ids match llama.cpp on malformed input too (tests pin ten such inputs).  The one
difference: a four-byte form spelling a value above U+10FFFF (e.g. F4 90 80 80, F7 BF
BF BF) makes llama.cpp throw `std::invalid_argument("invalid codepoint")` from inside
`llama_tokenize`, which aborts the whole process; we read it as one U+FFFD.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass, field
from enum import IntEnum
from itertools import accumulate
from typing import Iterable, Sequence

import numpy as np

from . import pretokenizer as pre_mod
from . import tokenizer_cache
from .bpe import bpe_merge
from .errors import TokenizerError
from .utf8 import StreamDecoder, decode_utf8_like_llama

log = logging.getLogger(__name__)

# At most this many tokens (and merges): 2,097,152.  The largest real vocabularies are
# ~262k; the cap bounds the memory a hostile file can make the tables take.
MAX_VOCAB = 1 << 21
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")

# `_encode_chunk` remembers only chunks up to this many bytes, so that no key of its
# 200,000 entries is long (before, a key was a whole chunk, however long): an entry is
# at most ~700 bytes (a 64-byte key, 64 ids), typically ~200.  Longer chunks barely
# repeat: 12 of the 254k chunks of the bench's 1 MB text are longer.
CACHE_CHUNK_BYTES = 64


def _warn_pre_mismatch(name: str) -> None:
    log.warning("pretokenizer %r is not implemented; using qwen2 rules (ids may differ "
                "from llama.cpp)", name)


class TokenType(IntEnum):
    """`tokenizer.ggml.token_type` values (llama.cpp's llama_token_type)."""

    UNDEFINED = 0
    NORMAL = 1
    UNKNOWN = 2
    CONTROL = 3
    USER_DEFINED = 4
    UNUSED = 5
    BYTE = 6


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map.

    The 188 bytes that print as themselves ('!'..'~', '¡'..'¬', '®'..'ÿ') keep their
    code point; the other 68 (controls, space, DEL, NBSP, soft hyphen, ...) are shifted,
    in byte order, to U+0100, U+0101, ...  So 0x20 (space) becomes U+0120 'Ġ' and 0x0A
    (newline) U+010A 'Ċ'.
    """
    printable = [*range(ord("!"), ord("~") + 1),
                 *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    mapping, shifted = {}, 0
    for b in range(256):
        if b in printable:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + shifted)
            shifted += 1
    return mapping


BYTE_TO_CHAR = bytes_to_unicode()
CHAR_TO_BYTE = {c: b for b, c in BYTE_TO_CHAR.items()}
# str.translate table: stand-in character -> the character with the byte's value (then
# latin-1 encode)
_UNMAP = {ord(c): b for c, b in CHAR_TO_BYTE.items()}


def unmap_token_text(text: str) -> bytes:
    """A vocabulary string in GPT-2 stand-in characters -> the raw bytes it represents.

    A character outside the map (never seen in a real byte-level vocabulary) is kept as
    its UTF-8.
    """
    translated = text.translate(_UNMAP)
    try:
        return translated.encode("latin-1")
    except UnicodeEncodeError:
        return b"".join(bytes([CHAR_TO_BYTE[c]]) if c in CHAR_TO_BYTE
                        else c.encode("utf-8") for c in text)


def unmap_many(texts: list[str]) -> list[bytes]:
    """`unmap_token_text` of each string, in one `translate` and one `encode` pass.

    Every stand-in is one character and stands for one byte, so the joined text keeps
    each string's length and can be cut back by lengths.  Any character outside latin-1
    (never in a byte-level vocabulary) takes the per-string path, with the same results.
    """
    try:
        joined = "".join(texts).translate(_UNMAP).encode("latin-1")
    except UnicodeEncodeError:
        return [unmap_token_text(t) for t in texts]
    ends = list(accumulate(map(len, texts)))
    return [joined[a:b] for a, b in zip([0, *ends], ends)]


def map_bytes(data: bytes) -> str:
    """Raw bytes -> the GPT-2 stand-in string (how the vocabulary would spell them)."""
    return "".join(BYTE_TO_CHAR[b] for b in data)


@dataclass
class Tokenizer:
    """A byte-level BPE tokenizer.  Build it with `from_gguf` or `from_parts`.

    Attributes hold what the GGUF holds: `tokens` (vocabulary strings as stored),
    `token_types`, `merges` ("left right" strings, rank = index), the BOS/EOS ids and
    the add-BOS/EOS policy.

    Construction validates the vocabulary, because a model file is untrusted input: a
    malformed one fails here with a `TokenizerError` naming the entry (token types in
    0-6 and as many as tokens; a BYTE token spelled `<0xHH>`; every merge two tokens of
    the vocabulary separated by a space; BOS/EOS/EOT ids inside the vocabulary; at most
    `MAX_VOCAB` tokens and merges), instead of a `ValueError` deep inside `encode` or
    silently wrong ids.  Checked on the real vocabularies (Qwen2.5/Qwen3, SmolLM2):
    every merge names two tokens, so the rule rejects no file llama.cpp tokenizes
    right.  The checks ride on the loops that build the tables anyway (~2 dict lookups
    per merge), so loading costs no measurable extra time.
    """

    tokens: list[str]
    merges: list[str]
    token_types: np.ndarray
    pre_name: str
    bos_id: int | None = None
    eos_id: int | None = None
    add_bos: bool = False
    add_eos: bool = False
    chat_template: str | None = None
    eot_ids: tuple[int, ...] = ()
    pre_mismatch: str | None = field(default=None, init=False)

    def __post_init__(self):
        self._check_vocabulary()
        pre = pre_mod.for_gguf_name(self.pre_name)
        if pre is None:
            # Honesty over silence: go on with Qwen2 rules, remember it, say it once.
            self.pre_mismatch = self.pre_name
            _warn_pre_mismatch(self.pre_name)
            pre = pre_mod.QWEN2
        self.pretokenizer = pre
        types = self.token_types
        special = ((types == TokenType.CONTROL) | (types == TokenType.USER_DEFINED)
                   | (types == TokenType.UNKNOWN))
        # Bytes each id stands for: stand-in strings for normal tokens, literal text for
        # markers.
        self.token_bytes: list[bytes] = []
        unmapped = unmap_many(self.tokens)
        for tok, raw, kind in zip(self.tokens, unmapped, types.tolist()):
            if kind in (TokenType.CONTROL, TokenType.USER_DEFINED, TokenType.UNKNOWN):
                self.token_bytes.append(tok.encode("utf-8"))
            elif kind in (TokenType.NORMAL, TokenType.UNDEFINED):
                self.token_bytes.append(raw)
            elif kind == TokenType.BYTE:
                self.token_bytes.append(self._byte_token(tok))
            else:  # UNUSED padding entries spell nothing
                self.token_bytes.append(b"")
        # bytes -> id for BPE lookups; on a duplicate the later id wins (llama.cpp).
        pairs = zip(self.token_bytes, special.tolist())
        self.id_of: dict[bytes, int] = {
            b: i for i, (b, is_special) in enumerate(pairs) if b and not is_special}
        self.byte_id = [self.id_of.get(bytes([b])) for b in range(256)]
        self.ranks = self._merge_ranks()
        # Markers, longest first (ties by id, for determinism).
        order = sorted(np.flatnonzero(special).tolist(),
                       key=lambda i: (-len(self.token_bytes[i]), i))
        self.special_markers = [(self.token_bytes[i], i, int(types[i]))
                                for i in order if self.token_bytes[i]]
        self._cache: dict[bytes, tuple[int, ...]] = {}

    def _merge_ranks(self) -> dict[tuple[bytes, bytes], int]:
        """(left bytes, right bytes) -> rank; every merge must name two tokens.

        Written as whole-list passes (one `translate` of all merges, comprehensions,
        `map` over `dict.__contains__`, `dict(zip(...))`) so that the checks ride along
        for free: Qwen's 151k merges take ~0.2 s with the checks, as the per-merge loop
        without them did (measured side by side in one process).
        """
        merges = self.merges
        spaces = [m.find(" ", 1) for m in merges]
        if spaces and min(spaces) < 0:
            rank = spaces.index(-1)
            raise TokenizerError(f"merge #{rank} {merges[rank][:40]!r} is not two "
                                 "tokens separated by a space")
        try:  # every merge unmapped in one pass, then cut at its space (lengths kept)
            raw = "".join(merges).translate(_UNMAP).encode("latin-1")
        except UnicodeEncodeError:  # not a byte-level vocabulary: one side at a time
            lefts = [unmap_token_text(m[:s]) for m, s in zip(merges, spaces)]
            rights = [unmap_token_text(m[s + 1:]) for m, s in zip(merges, spaces)]
        else:
            ends = list(accumulate(map(len, merges)))
            starts = [0, *ends[:-1]]
            lefts = [raw[a:a + s] for a, s in zip(starts, spaces)]
            rights = [raw[a + s + 1:b] for a, s, b in zip(starts, spaces, ends)]
        known = self.id_of.__contains__
        if not (all(map(known, lefts)) and all(map(known, rights))):
            rank = next(r for r, (a, b) in enumerate(zip(lefts, rights))
                        if not (known(a) and known(b)))
            raise TokenizerError(f"merge #{rank} {merges[rank][:40]!r} names a token "
                                 "that is not in the vocabulary")
        pairs = list(zip(lefts, rights))
        ranks = dict(zip(pairs, range(len(pairs))))  # keys in rank order
        if len(ranks) != len(pairs):
            # A repeated merge kept its last rank above; the first (lowest) must win, as
            # in llama.cpp's map.
            for rank in range(len(pairs) - 1, -1, -1):
                ranks[pairs[rank]] = rank
        return ranks

    def _check_vocabulary(self) -> None:
        """Counts, token types and special ids; normalises `token_types` to int32."""
        n = len(self.tokens)
        if n == 0:
            raise TokenizerError("the vocabulary is empty")
        if n > MAX_VOCAB or len(self.merges) > MAX_VOCAB:
            raise TokenizerError(f"{n:,} tokens and {len(self.merges):,} merges: more "
                                 f"than the {MAX_VOCAB:,} this engine accepts")
        types = np.asarray(self.token_types)
        if types.ndim != 1 or len(types) != n:
            raise TokenizerError(f"{n:,} tokens but {types.size:,} token types")
        if types.dtype.kind not in "iu":
            raise TokenizerError(f"token types should be integers, are {types.dtype}")
        bad = np.flatnonzero((types < 0) | (types > max(TokenType)))
        if bad.size:
            i = int(bad[0])
            raise TokenizerError(f"token {i} ({self.tokens[i][:40]!r}) has type "
                                 f"{int(types[i])}; token types are "
                                 f"0-{int(max(TokenType))}")
        self.token_types = types.astype(np.int32, copy=False)
        named = [("BOS", self.bos_id), ("EOS", self.eos_id)]
        named += [("end-of-turn", t) for t in self.eot_ids]
        for what, tid in named:
            if tid is not None and not 0 <= int(tid) < n:
                raise TokenizerError(f"the {what} token id {tid} is outside the "
                                     f"vocabulary ({n:,} tokens)")

    def _byte_token(self, tok: str) -> bytes:
        """The one byte a BYTE-typed token stands for: `<0xHH>` or one stand-in."""
        m = _BYTE_TOKEN.fullmatch(tok)
        if m:
            return bytes([int(m.group(1), 16)])
        raw = unmap_token_text(tok)
        if tok.startswith("<0x") or len(raw) != 1:
            kinds = self.token_types.tolist()
            i = next(j for j, t in enumerate(self.tokens)
                     if t == tok and kinds[j] == TokenType.BYTE)
            raise TokenizerError(f"token {i} {tok[:40]!r} is typed BYTE but spells no "
                                 "single byte (expected <0x00> ... <0xFF>)")
        return raw

    # --- construction -----------------------------------------------------------------

    @classmethod
    def from_gguf(cls, gguf, *,
                  cache_dir: str | os.PathLike | None = None) -> "Tokenizer":
        """Build from an open `GGUFFile` (only the `tokenizer.*` keys; no weights).

        `cache_dir`: a directory to keep the built tables in from run to run
        (tokenizer_cache.py; catalog passes its cache directory); None: build them."""
        types, params = _gguf_params(gguf)
        key = (tokenizer_cache.tables_key(gguf, types, params)
               if cache_dir is not None else None)
        cached = tokenizer_cache.load(cache_dir, key)
        if isinstance(cached, Tokenizer):
            if cached.pre_mismatch:
                _warn_pre_mismatch(cached.pre_mismatch)   # as a build would
            return cached
        tokens = [t.decode("utf-8", errors="replace")
                  for t in gguf.get_strings("tokenizer.ggml.tokens")]
        merges = [m.decode("utf-8", errors="replace")
                  for m in gguf.get_strings("tokenizer.ggml.merges")]
        try:
            tok = cls.from_parts(tokens, merges, types, **params)
        except TokenizerError as e:
            raise TokenizerError(f"{gguf.path}: {e}") from None
        tokenizer_cache.save(cache_dir, key, tok)
        return tok

    @classmethod
    def from_parts(cls, tokens: Sequence[str], merges: Sequence[str],
                   token_types: Sequence[int] | None = None, *, pre: str = "qwen2",
                   bos_id: int | None = None, eos_id: int | None = None,
                   add_bos: bool | None = None, add_eos: bool | None = None,
                   chat_template: str | None = None,
                   eot_ids: Iterable[int] = ()) -> "Tokenizer":
        """Build from plain lists.  Without `token_types`, `<|...|>` entries are the
        control markers."""
        tokens = list(tokens)
        if token_types is None:
            token_types = [TokenType.CONTROL
                           if t.startswith("<|") and t.endswith("|>") and len(t) > 4
                           else TokenType.NORMAL for t in tokens]
        # Not converted here: the range check must see the values as given (a 2^40
        # would not fit int32, a uint32 2^32-1 would wrap to -1).
        types = np.asarray(token_types)
        if types.size == 0:
            types = types.astype(np.int32)
        pre_rules = pre_mod.for_gguf_name(pre)
        if add_bos is None:  # llama.cpp's default: Llama 3 style vocabularies add BOS
            add_bos = pre_rules is not None and pre_rules.ignore_merges
        return cls(tokens=tokens, merges=list(merges), token_types=types, pre_name=pre,
                   bos_id=bos_id, eos_id=eos_id, add_bos=bool(add_bos),
                   add_eos=bool(add_eos), chat_template=chat_template,
                   eot_ids=tuple(eot_ids) or ((eos_id,) if eos_id is not None else ()))

    # --- encoding ---------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return len(self.tokens)

    def encode(self, text: str | bytes, *, special: bool = True) -> list[int]:
        """Text -> ids, with the model's BOS/EOS policy applied (for plain prompts)."""
        ids = self.encode_raw(text, special=special)
        if self.add_bos and self.bos_id is not None:
            ids.insert(0, self.bos_id)
        if self.add_eos and self.eos_id is not None:
            ids.append(self.eos_id)
        return ids

    def encode_raw(self, text: str | bytes, *, special: bool = True) -> list[int]:
        """Text -> ids with no BOS/EOS: chat templates own every structural token."""
        if isinstance(text, str):
            data = text.encode("utf-8", "surrogatepass")
        else:
            data = bytes(text)
        ids: list[int] = []
        for piece in self._partition(data, special):
            if isinstance(piece, int):
                ids.append(piece)
            else:
                for chunk in self.pretokenizer.split(decode_utf8_like_llama(piece)):
                    chunk_bytes = chunk.encode("utf-8", "surrogatepass")
                    ids.extend(self._encode_chunk(chunk_bytes))
        return ids

    def _partition(self, data: bytes, special: bool) -> list[bytes | int]:
        """Cut marker texts out of `data`: a list of raw byte fragments and marker ids.

        Same order as llama.cpp's `tokenizer_st_partition`: for each marker (longest
        first), every still-raw fragment is split at each occurrence.  A marker absent
        from `data` is skipped with one scan in C: without that, each of Qwen's 26
        markers walked the fragment list in Python, and 1 MB of "<|im_start|>a" spent
        ~180 ms here.
        """
        pieces: list[bytes | int] = [data] if data else []
        for text, tid, kind in self.special_markers:
            if (not special and kind != TokenType.USER_DEFINED) or text not in data:
                continue
            out: list[bytes | int] = []
            for piece in pieces:
                if isinstance(piece, int) or text not in piece:
                    out.append(piece)
                    continue
                parts = piece.split(text)
                for k, part in enumerate(parts):
                    if k:
                        out.append(tid)
                    if part:
                        out.append(part)
            pieces = out
        return pieces

    def _encode_chunk(self, chunk: bytes) -> tuple[int, ...]:
        cached = self._cache.get(chunk)
        if cached is not None:
            return cached
        if self.pretokenizer.ignore_merges and chunk in self.id_of:
            ids: tuple[int, ...] = (self.id_of[chunk],)
        else:
            ids = tuple(self._ids_of_parts(self.bpe(chunk)))
        if len(chunk) <= CACHE_CHUNK_BYTES:
            if len(self._cache) > 200_000:
                self._cache.clear()
            self._cache[chunk] = ids
        return ids

    def bpe(self, chunk: bytes) -> list[bytes]:
        """Merge the bytes of one chunk: lowest rank first, leftmost among equal ranks.

        `bpe_merge` with this vocabulary's ranks: a heap of candidate pairs over a
        linked list of parts, O(n log n) in the chunk's length (its docstring says why,
        and what the heap replaced).
        """
        return bpe_merge(chunk, self.ranks)[0]

    def _ids_of_parts(self, parts: list[bytes]) -> Iterable[int]:
        for p in parts:
            tid = self.id_of.get(p)
            if tid is not None:
                yield tid
            else:  # a merge result missing from the vocabulary: spell it in byte tokens
                yield from (self.byte_id[b] for b in p if self.byte_id[b] is not None)

    # --- decoding ---------------------------------------------------------------------

    def _check(self, tid: int) -> int:
        if not 0 <= tid < len(self.token_bytes):
            raise TokenizerError(f"token id {tid} is outside the vocabulary (size "
                                 f"{len(self.token_bytes)})")
        return tid

    def token_to_bytes(self, tid: int) -> bytes:
        return self.token_bytes[self._check(int(tid))]

    def decode_bytes(self, ids: Iterable[int], *, skip_special: bool = False) -> bytes:
        """Ids -> the exact bytes they spell (markers too, unless `skip_special`)."""
        types, hidden = self.token_types, (TokenType.CONTROL, TokenType.UNKNOWN)
        return b"".join(self.token_bytes[self._check(int(t))] for t in ids
                        if not (skip_special and types[int(t)] in hidden))

    def decode(self, ids: Iterable[int], *, skip_special: bool = False) -> str:
        """Ids -> text.  Bytes that are not valid UTF-8 show as U+FFFD."""
        data = self.decode_bytes(ids, skip_special=skip_special)
        return data.decode("utf-8", errors="replace")

    def is_special(self, tid: int) -> bool:
        kind = int(self.token_types[self._check(int(tid))])
        return kind in (TokenType.CONTROL, TokenType.USER_DEFINED)

    def token_id(self, text: str) -> int:
        """The id of a marker or vocabulary entry spelled `text` (e.g. '<|im_end|>')."""
        raw = text.encode("utf-8")
        for marker, tid, _ in self.special_markers:
            if marker == raw:
                return tid
        if raw in self.id_of:
            return self.id_of[raw]
        raise TokenizerError(f"{text!r} is not a single token of this vocabulary")

    def stream(self, *, skip_special: bool = False) -> "StreamDecoder":
        return StreamDecoder(self, skip_special=skip_special)


def _gguf_params(gguf) -> tuple:
    """The token types and `from_parts` keywords a GGUF's tokenizer keys hold, after
    the checks that need no string array built (a hostile file fails here, cheaply)."""
    path = gguf.path
    if not gguf.has("tokenizer.ggml.tokens"):
        raise TokenizerError(f"{path}: the file has no tokenizer (metadata key "
                             "'tokenizer.ggml.tokens' is missing)")
    model = gguf.get_str("tokenizer.ggml.model", "")
    if model != "gpt2":
        raise TokenizerError(f"{path}: tokenizer model {model!r} is not supported "
                             "(only byte-level BPE, 'gpt2')")
    if not gguf.has("tokenizer.ggml.merges"):
        raise TokenizerError(f"{path}: the BPE tokenizer has no merges "
                             "('tokenizer.ggml.merges' is missing)")
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"):
        n = gguf.array_length(key)  # before building millions of Python strings
        if n > MAX_VOCAB:
            raise TokenizerError(f"{path}: {key!r} holds {n:,} entries; at most "
                                 f"{MAX_VOCAB:,} are accepted")
    types = (gguf.get_array("tokenizer.ggml.token_type")
             if gguf.has("tokenizer.ggml.token_type") else None)

    def opt_id(key):
        return gguf.get_int(key) if gguf.has(key) else None

    def opt_bool(key):
        return gguf.get_bool(key) if gguf.has(key) else None

    eos = opt_id("tokenizer.ggml.eos_token_id")
    eot = [i for i in (eos, opt_id("tokenizer.ggml.eot_token_id")) if i is not None]
    template = (gguf.get_str("tokenizer.chat_template")
                if gguf.has("tokenizer.chat_template") else None)
    return types, dict(pre=gguf.get_str("tokenizer.ggml.pre", "default"),
                       bos_id=opt_id("tokenizer.ggml.bos_token_id"), eos_id=eos,
                       add_bos=opt_bool("tokenizer.ggml.add_bos_token"),
                       add_eos=opt_bool("tokenizer.ggml.add_eos_token"),
                       chat_template=template, eot_ids=tuple(dict.fromkeys(eot)))
