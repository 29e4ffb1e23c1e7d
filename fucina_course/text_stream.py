"""Answer text as it streams: what a reader is shown, and what is held back.

Two filters sit between the decoded text of an answer and whoever shows it, and both face
the same problem: a piece of text that might be the beginning of something that must not
be shown (a stop string, a `<think>` tag) cannot be shown yet, and cannot be dropped
either, until the next piece says which it is. `held_back` is that rule, once:

* `TextStream` (chat turns, the CLI, and through them every server request): bytes ->
  characters (no half character), stop strings never shown, think blocks hidden unless
  asked for;
* `ThinkSplitter` (the server): the shown text -> (reasoning, content), the think block
  going to `reasoning_content`;
* `without_think`: a whole text's think blocks removed.
"""

from __future__ import annotations

from typing import Callable, Sequence, TextIO

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"

# Where an answer's visible text goes: a callable, a file (written and flushed), or None.
Stream = Callable[[str], object] | TextIO | None


def held_back(text: str, end: int, needles: Sequence[str]) -> int:
    """How many characters at the end of text[:end] must wait: the longest tail that is
    the beginning of one of `needles` without being all of it (0 if none is)."""
    hold = 0
    for s in needles:
        for n in range(min(len(s) - 1, end), hold, -1):
            if text.endswith(s[:n], 0, end):
                hold = n
                break
    return hold


def without_think(text: str) -> str:
    """`text` with every <think>...</think> block (and the newlines after it)
    removed; an unclosed block hides everything after it (the model is thinking)."""
    out, i = [], 0
    while True:
        j = text.find(THINK_OPEN, i)
        if j < 0:
            out.append(text[i:])
            return "".join(out)
        out.append(text[i:j])
        k = text.find(THINK_CLOSE, j)
        if k < 0:
            return "".join(out)
        i = k + len(THINK_CLOSE)
        while i < len(text) and text[i] == "\n":
            i += 1


class TextStream:
    """Decoded text of one answer -> the writer, minus what must not be shown.

    Bytes go through the tokenizer's `StreamDecoder` (no half characters); text
    that could be the start of a stop string is held back until it is known not to
    be one (so a stop string is never shown); a think block is hidden unless asked
    for."""

    def __init__(self, tokenizer, stream: Stream, stops: Sequence[str],
                 show_think: bool):
        self.decoder = tokenizer.stream(skip_special=True)
        if stream is None:
            self.write = None
        elif callable(stream):
            self.write = stream
        else:
            def write(text, _f=stream):
                _f.write(text)
                if hasattr(_f, "flush"):
                    _f.flush()
            self.write = write
        self.stops = [s for s in stops if s]
        self.show_think = show_think
        self.raw, self.shown, self.stop_at = "", 0, None

    def push(self, tid: int) -> bool:
        """Add one token; True if it completed a stop string."""
        self.raw += self.decoder.push(tid)
        return self._emit(final=False)

    def finish(self) -> None:
        if self.stop_at is None:
            self.raw += self.decoder.flush()
        self._emit(final=True)

    def visible(self) -> str:
        text = self.raw if self.stop_at is None else self.raw[:self.stop_at]
        return text if self.show_think else without_think(text)

    def _emit(self, final: bool) -> bool:
        if self.stop_at is None:
            hits = [i for i in (self.raw.find(s) for s in self.stops) if i >= 0]
            if hits:
                self.stop_at, final = min(hits), True
        end = len(self.raw) if self.stop_at is None else self.stop_at
        if not final:
            end -= held_back(self.raw, end, self.stops)
        text = self.raw[:end] if self.show_think else without_think(self.raw[:end])
        if len(text) > self.shown:
            if self.write is not None:
                self.write(text[self.shown:])
            self.shown = len(text)
        return self.stop_at is not None


class ThinkSplitter:
    """Raw answer text -> (reasoning, content), piece by piece.

    Text inside <think>...</think> is reasoning, the rest content; the tags and
    the newlines that frame the block are dropped (as `chat.without_think` drops
    them).  Text that could be the start of a tag is held back until it is known
    not to be one, so a streamed delta never shows half a tag.  `thinking=True`
    starts inside a block (a template that opens it in the prompt)."""

    def __init__(self, thinking: bool = False):
        self.thinking = thinking
        self.buf = ""
        self.lead = True              # drop newlines at the start of the next part

    def push(self, text: str, final: bool = False) -> tuple[str, str]:
        self.buf += text
        reasoning, content = [], []
        while self.buf:
            tag = THINK_CLOSE if self.thinking else THINK_OPEN
            out = reasoning if self.thinking else content
            if self.lead:
                stripped = self.buf.lstrip("\n")
                if not stripped and not final:
                    self.buf = ""
                    break
                self.buf, self.lead = stripped, False
                continue
            i = self.buf.find(tag)
            if i >= 0:
                piece = self.buf[:i]
                out.append(piece.rstrip("\n") if self.thinking else piece)
                self.buf = self.buf[i + len(tag):]
                self.thinking, self.lead = not self.thinking, True
                continue
            if final:
                out.append(self.buf)
                self.buf = ""
                break
            hold = held_back(self.buf, len(self.buf), [tag])   # a tag's beginning
            if self.thinking:            # trailing newlines may frame </think>
                body = self.buf[:len(self.buf) - hold]
                hold = len(self.buf) - len(body.rstrip("\n"))
            cut = len(self.buf) - hold
            out.append(self.buf[:cut])
            self.buf = self.buf[cut:]
            break
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        return self.push("", final=True)
