"""The strings the tokenizer is pinned on: a hand-written corpus of tricky cases and a seeded
generator of random mixed-script strings.  Both the golden-file script and the tests import this.

Each corpus entry targets one rule of the byte-level BPE pipeline; the comment says which.
"""

from __future__ import annotations

import numpy as np

CORPUS: list[str] = [
    # empty and pure whitespace: \s+(?!\S) vs \s+, newline absorption
    "", " ", "  ", "   ", "\t", "\t\t", "\n", "\n\n", "\n\n\n", "\r\n", "\r\n\r\n", " \n", "\n ", " \t \n ",
    "a  b", "a   b", "a \n b", "   leading spaces", "trailing spaces   ", "tab\tseparated\tvalues",
    "line one\r\nline two\r\n", "x\x0by\x0cz", "nbsp\u00a0here", "ideographic\u3000space", "nel\x85line",
    "fs\x1cgs\x1drs\x1eus\x1f",
    # a whitespace run before a word donates its last space to the word
    "hello     world", "if x:\n        return y",
    # digits: one per chunk for qwen2; long numbers; decimals; unicode digits
    "0", "1234567", "3.14159", "1,000,000.00", "2024-11-29T14:13:00Z", "v1.2.3-rc4", "0xDEADBEEF",
    "٠١٢٣٤٥٦٧٨٩", "१२३४", "²³¹ ½ Ⅻ",
    # contractions in every case, and apostrophes that are not contractions
    "I'll we've they're she's it'd I'm don't", "I'LL WE'VE THEY'RE SHE'S IT'D I'M DON'T",
    "I'Ll We'Ve", "'s 's' rock'n'roll ''", "l'\u017fa", "it\u2019s curly",
    # punctuation runs absorb trailing newlines
    "Hello!\n\nWorld?!\n", "...\n", "end.\r\n", "--- *** ===\n\n",
    # code in several languages
    "def f(x):\n    return x ** 2  # square\n",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }",
    "fn main() -> Result<(), Box<dyn Error>> { println!(\"{}\", 42); Ok(()) }",
    "const add = (a, b) => a + b; // arrow\nconsole.log(add(1, 2));",
    "SELECT id, name FROM users WHERE age >= 18 ORDER BY name;",
    "<div class=\"x\">&amp;&lt;</div>", "$ ls -la | grep '^d' > out.txt 2>&1",
    "\\begin{equation} E = mc^2 \\end{equation}",
    # scripts: CJK, Japanese, Korean, Arabic, Hebrew, Cyrillic, Greek, Thai, Devanagari
    "日本語のテキストです。", "中文文本，标点符号！", "한국어 텍스트입니다", "مرحبا بالعالم", "שלום עולם",
    "Привет, мир!", "Γειά σου Κόσμε", "สวัสดีชาวโลก", "नमस्ते दुनिया",
    # combining marks: precomposed vs decomposed
    "café naïve résumé", "cafe\u0301 nai\u0308ve", "a\u0301\u0302\u0303", "Z\u0351\u036b\u0343a\u0310l\u0352g\u0310o",
    # emoji, ZWJ sequences, flags, skin tones, variation selectors
    "😀", "👍🏽", "👨‍👩‍👧‍👦", "🇮🇹🇫🇷", "❤️", "I ❤️ 🍕 and 🐍!", "🏳️‍🌈",
    # special markers alone, adjacent, inside text, broken
    "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|im_start|><|im_end|>",
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "<|im_", "<|im_start", "im_start|>", "<||>", "<|unknown_marker|>", "<|im_start|x", "<<|im_end|>>",
    "<think>\nreasoning\n</think>\n\nanswer", "<tool_call>{\"name\": \"f\"}</tool_call>",
    "<|fim_prefix|>def <|fim_suffix|>\n<|fim_middle|>",
    # a long word and a long run of one symbol
    "Pneumonoultramicroscopicsilicovolcanoconiosis", "=" * 40, "a" * 64,
    # mixed
    "The year 1984 had 365 days; π≈3.14, e≈2.718!", "Mixed: English, 日本語, العربية, and 😀 in one line.",
]

# Malformed UTF-8 (bytes): llama.cpp decodes these leniently; the tokenizer must match it too.
MALFORMED: list[bytes] = [
    b"\xff", b"abc\x80def", b"\xc0\x80", b"\xe4\xb8", b"\xf0\x9f\x98", b"a\xffb\xed\xa0\x80c",
    b"\xc3(", b"\xe2\x28\xa1", b"\xf8\x88\x80\x80\x80", b"ok \xfe\xfe ok",
]

# Long runs of one character class, name -> the repeated unit.  Most are one pre-token
# chunk however long (letters, spaces, punctuation, newlines, CJK), the input on which a
# BPE that rescans its pairs is quadratic (20,000 x "a" took 2.7 s); digits and "a " are
# the opposite, thousands of one- or two-character chunks.  Tests build them with
# `long_run`.
RUN_UNITS: dict[str, str] = {
    "letters": "a", "spaces": " ", "digits": "7", "dashes": "-", "newlines": "\n",
    "tabs": "\t", "ab": "ab", "CJK": "日", "a-space": "a ", "accented": "é",
    "emoji": "😀", "crlf": "\r\n", "markers": "<|im_start|>",
    "marker-text": "<|im_start|>a",
}


def long_run(unit: str, n_chars: int) -> str:
    """`unit` repeated to about `n_chars` characters (a whole number of units)."""
    return unit * max(1, n_chars // len(unit))


def random_run(alphabet: str, n_chars: int, seed: int = 42) -> str:
    """`n_chars` characters drawn from `alphabet`: one long chunk of varied content when
    the alphabet is letters only (a pasted DNA sequence, "ACGT")."""
    rng = np.random.default_rng(seed)
    return "".join(alphabet[i] for i in rng.integers(len(alphabet), size=n_chars))


# Character pools for the random strings: (weight, characters)
_POOL = [
    (6, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"),
    (2, "0123456789"),
    (3, " " * 6 + "\t\n\r"),
    (1, "\x0b\x0c\u00a0\u3000\u2009\x85"),
    (3, ".,;:!?'\"()[]{}<>-_=+*/\\|@#$%^&~`"),
    (2, "éèêëàâäôöûüçñßøåæœ\u0301\u0308"),
    (2, "日本語中文漢字かなカタカナ한국어"),
    (1, "مرحباالعالم٠١٢٣٤٥"),
    (1, "ПриветмирΓειάσουκόσμε"),
    (1, "नमस्तेदुनियाสวัสดี"),
    (1, "😀👍🏽❤️🍕🐍\u200d🇮🇹"),
]
_PIECES = ["'s", "'LL", "'re", "'Ve", "'d", "<|im_start|>", "<|im_end|>", "<|im_", "|>", "<think>",
           "</think>", "<|endoftext|>", "\r\n", "    ", "123456", "3.14", "def ", "=>", "//", "\n\n"]


def random_strings(n: int, seed: int = 1234) -> list[str]:
    """`n` seeded random strings mixing scripts, whitespace, punctuation, digits and markers."""
    rng = np.random.default_rng(seed)
    weights = np.array([w for w, _ in _POOL], dtype=float)
    weights /= weights.sum()
    out = []
    for _ in range(n):
        length = int(rng.integers(1, 48))
        parts = []
        for _ in range(length):
            if rng.random() < 0.08:
                parts.append(_PIECES[int(rng.integers(len(_PIECES)))])
            else:
                chars = _POOL[int(rng.choice(len(_POOL), p=weights))][1]
                parts.append(chars[int(rng.integers(len(chars)))])
        out.append("".join(parts))
    return out
