"""UTF-8 at the tokenizer's two edges: bytes in, read as llama.cpp reads them (malformed
ones included: tokenizer.py's docstring says why), and text out one token at a time,
only ever whole characters (`StreamDecoder`)."""

from __future__ import annotations

import codecs


def decode_utf8_like_llama(data: bytes) -> str:
    """Decode bytes to code points the way llama.cpp's `unicode_cpts_from_utf8` does.

    Valid UTF-8 takes the fast path.  Otherwise: a lead byte decides the length
    (0xxxxxxx 1, 110xxxxx 2, 1110xxxx 3, 11110xxx 4); if the continuation bytes are
    there the code point is taken as spelled (overlong forms and surrogates included),
    else that one byte becomes U+FFFD.
    """
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        pass
    out, i, n = [], 0, len(data)
    while i < n:
        b = data[i]
        if b < 0x80:
            out.append(b); i += 1; continue
        length = (2 if b >> 5 == 0b110 else 3 if b >> 4 == 0b1110
                  else 4 if b >> 3 == 0b11110 else 0)
        cont = data[i + 1:i + length] if length else b""
        if length and len(cont) == length - 1 and all(c >> 6 == 0b10 for c in cont):
            cp = b & (0x7F >> length)
            for c in cont:
                cp = (cp << 6) | (c & 0x3F)
            # llama.cpp aborts above U+10FFFF (tokenizer.py's docstring)
            out.append(cp if cp <= 0x10FFFF else 0xFFFD)
            i += length
        else:
            out.append(0xFFFD); i += 1
    return "".join(map(chr, out))


class StreamDecoder:
    """Decode one id at a time and emit only complete UTF-8.

    A token can end in the middle of a multi-byte character (an emoji is often 2-3
    tokens): the incomplete tail is held back until the next token completes it, so a
    terminal never shows half a character.  `flush()` releases whatever is left at the
    end of the stream.  `Tokenizer.stream()` makes one.
    """

    def __init__(self, tokenizer, *, skip_special: bool = False):
        self.tokenizer = tokenizer
        self.skip_special = skip_special
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, tid: int) -> str:
        """Add one id; return the text that is now complete (possibly '')."""
        data = self.tokenizer.decode_bytes([tid], skip_special=self.skip_special)
        return self._decoder.decode(data)

    def flush(self) -> str:
        """End of stream: the held-back tail (a cut-off character becomes U+FFFD)."""
        return self._decoder.decode(b"", final=True)
