"""Split text into the chunks that BPE merges never cross.

Byte-level BPE does not run over a whole text: a *pretokenizer* first cuts it into
word-shaped chunks, and merges stay inside a chunk.  Move one boundary and the ids
change, so this module has a single bar: the same chunks as llama.cpp, for every
pretokenizer it implements.

How we run it: the collapse trick
---------------------------------
The Qwen2 split is a regular expression with Unicode classes (`\\p{L}` letters, `\\p{N}`
numbers), here cut in two at a `|`:

    (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}
    | ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+

Python's built-in `re` knows no `\\p{...}` classes.  We borrow the trick llama.cpp uses
for patterns it has no hand-written scanner for (C++ `std::regex` knows no Unicode
classes either): *collapse* the text first.  Every code point >= 128 is replaced by one
stand-in character for its class (any letter -> one "letter" character, any number ->
one "number" character, any Unicode space -> a vertical tab, anything else -> an "other"
character), ASCII stays as it is, and the pattern is rewritten over those stand-ins
(`\\p{L}` becomes `[A-Za-z<letter>]`).  Collapsing maps one code point to one
character, so match positions on the collapsed text are chunk boundaries on the real
text, and `re` scans at C speed.

For Qwen2, GPT-2 and Llama 3 the llama.cpp version we test against (llama-cpp-python
0.3.36) runs hand-written code-point loops that implement the same expressions; the
parity tests compare our chunks (through the final ids) with those loops on thousands of
strings.

Consequences worth knowing, each pinned by a test:
* `\\s` means the 25 Unicode White_Space code points (the set llama.cpp uses), not
  Python's `\\s` (which would also accept the ASCII separators 0x1C-0x1F).
* The case-insensitive contractions are ASCII-only (`'[sS]`, `'[lL][lL]`, ...), as in
  llama.cpp; a real `(?i)` would also fold U+017F LATIN SMALL LETTER LONG S into `s`.
* Letter/number classes come from Unicode 15.1 (the `unicodedata2` package pinned to
  15.1.0), the version of llama.cpp's own table.  Python 3.11's built-in `unicodedata`
  is 14.0: with it, the ~5,000 CJK ideographs added in 15.0/15.1 would split
  differently.
* Digits: Qwen2 takes `\\p{N}` with no quantifier, so every digit is its own chunk
  (Llama 3 takes up to three, `\\p{N}{1,3}`; GPT-2 takes a whole run).

Cost: linear in the text, long runs of one character class included (they are what
BPE's cost hangs on, tokenizer.py).  No run is rescanned from each of its positions:
`\\s*[\\r\\n]+` may scan a whitespace run to its end and fail, but then `\\s+(?!\\S)`
or `\\s+` matches at the same position and consumes the run (all but its last
character), so each run is scanned a bounded number of times.  Measured for the four
pretokenizers on 30 kinds of run (letters, spaces, digits, punctuation, newlines, tabs,
CJK, "a ", "'s", combining marks, U+3000, ...): 400,000 characters take 6-12x the time
of 50,000 (8x is linear); per character, from 0.02 us (one chunk) to 0.4 us (a chunk
per digit: the Python loop over matches).

Pretokenizers implemented (selected by the GGUF key `tokenizer.ggml.pre`): `qwen2`,
`llama3`, `gpt2` and `smollm` (a `\\p{N}` pass, then GPT-2 on each piece).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

# Stand-ins for non-ASCII code points on the collapsed text.  C1 control characters
# never survive collapsing (every code point >= 128 is replaced), so they cannot collide
# with real text.
LETTER, NUMBER, MARK, OTHER = "\x80", "\x81", "\x82", "\x83"
SPACE = "\x0b"  # non-ASCII white space collapses to a vertical tab, as in llama.cpp

# The Unicode White_Space property (stable since Unicode 6): the only characters `\s`
# matches.
WHITE_SPACE = (0x09, 0x0A, 0x0B, 0x0C, 0x0D, 0x20, 0x85, 0xA0, 0x1680,
               *range(0x2000, 0x200B), 0x2028, 0x2029, 0x202F, 0x205F, 0x3000)

# How the pattern vocabulary is spelled over collapsed text.
_CLASSES = {
    r"\p{L}": "A-Za-z" + LETTER,
    r"\p{N}": "0-9" + NUMBER,
    r"\p{M}": MARK,
    r"\s": "\t\n\x0b\x0c\r ",
}


def _collapse_pattern(pattern: str) -> str:
    """Rewrite `\\p{L}`, `\\p{N}`, `\\p{M}` and `\\s`/`\\S` for the collapsed alphabet.

    Inside a bracket expression a class becomes its members; outside, a bracket of its
    members.
    """
    out, i, inside = [], 0, False
    while i < len(pattern):
        if pattern[i] == "[" and (i == 0 or pattern[i - 1] != "\\"):
            inside = True
        elif pattern[i] == "]" and pattern[i - 1] != "\\":
            inside = False
        for name, members in _CLASSES.items():
            if pattern.startswith(name, i):
                out.append(members if inside else f"[{members}]")
                i += len(name)
                break
        else:
            if pattern.startswith(r"\S", i):
                out.append("[^" + _CLASSES[r"\s"] + "]")
                i += 2
            else:
                out.append(pattern[i])
                i += 1
    return "".join(out)


@lru_cache(maxsize=1)
def collapse_table() -> np.ndarray:
    """uint32[0x110000]: the collapsed stand-in of every code point (ASCII: itself).

    Built once per process from Unicode 15.1 categories (~0.2 s).
    """
    import unicodedata2

    stand_in = {"L": ord(LETTER), "N": ord(NUMBER), "M": ord(MARK)}
    other = ord(OTHER)
    table = np.array([stand_in.get(unicodedata2.category(chr(cp))[0], other)
                      for cp in range(0x110000)], dtype=np.uint32)
    table[np.array(WHITE_SPACE[6:])] = ord(SPACE)
    table[:128] = np.arange(128, dtype=np.uint32)
    return table


def code_points(text: str) -> np.ndarray:
    """The code points of `text` (lone surrogates included) as uint32."""
    return np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype=np.uint32)


def collapse(text: str) -> str:
    """Each non-ASCII code point replaced by its class stand-in; as long as `text`."""
    if text.isascii():
        return text
    collapsed = collapse_table()[code_points(text)].astype("<u4")
    return collapsed.tobytes().decode("utf-32-le")


@dataclass(frozen=True)
class Pretokenizer:
    """An ordered list of split patterns; each pass subdivides the last pass's pieces.

    Within a piece, a pass emits every match *and every gap between matches* as pieces
    (the gaps matter for patterns with no catch-all branch, such as GPT-2's, which has
    no final `\\s+`).
    """

    name: str
    patterns: tuple[str, ...]
    # Llama 3: a chunk that is itself a vocabulary entry is one token
    ignore_merges: bool = False

    @property
    def compiled(self) -> tuple[re.Pattern, ...]:
        return _compile(self.patterns)

    def split(self, text: str) -> list[str]:
        """The chunks of `text`, in order; they concatenate back to `text`."""
        if not text:
            return []
        collapsed = collapse(text)
        bounds = [(0, len(text))]
        for rx in self.compiled:
            refined = []
            for start, end in bounds:
                pos = start
                for m in rx.finditer(collapsed, start, end):
                    if m.start() > pos:
                        refined.append((pos, m.start()))
                    if m.end() > m.start():
                        refined.append((m.start(), m.end()))
                    pos = m.end()
                if pos < end:
                    refined.append((pos, end))
            bounds = refined
        return [text[a:b] for a, b in bounds]


@lru_cache(maxsize=None)
def _compile(patterns: tuple[str, ...]) -> tuple[re.Pattern, ...]:
    return tuple(re.compile(_collapse_pattern(p)) for p in patterns)


_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"

_TAIL = r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"

QWEN2 = Pretokenizer("qwen2", (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}" + _TAIL,))
LLAMA3 = Pretokenizer("llama3", (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}" + _TAIL,),
    ignore_merges=True)
GPT2 = Pretokenizer("gpt2", (_GPT2,))
SMOLLM = Pretokenizer("smollm", (r"\p{N}", _GPT2))

# `tokenizer.ggml.pre` values -> pretokenizer (the names llama.cpp maps to the same
# split rules).
BY_GGUF_NAME: dict[str, Pretokenizer] = {
    **{n: QWEN2 for n in ("qwen2", "deepseek-r1-qwen", "megrez", "stablelm2", "kormo")},
    **{n: LLAMA3 for n in ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1",
                           "pixtral", "dbrx", "smaug-bpe")},
    **{n: GPT2 for n in ("gpt-2", "gpt2", "phi-2", "mpt", "olmo", "jais", "roberta-bpe",
                         "jina-v1-en", "jina-v2-code", "exaone4")},
    **{n: SMOLLM for n in ("smollm", "starcoder", "refact", "command-r", "codeshell",
                           "exaone", "minerva-7b")},
}


def for_gguf_name(pre: str | None) -> Pretokenizer | None:
    """The pretokenizer for a `tokenizer.ggml.pre` value, or None if not implemented."""
    return BY_GGUF_NAME.get(pre or "")
