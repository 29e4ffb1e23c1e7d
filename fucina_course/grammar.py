"""Structured output: JSON and JSON-schema constrained decoding as a logit mask.

A grammar does not change the model; it changes which tokens the sampler may pick.
Before each draw, every token that cannot continue the text into something the
grammar accepts gets a score of -inf, so the softmax gives it probability 0 and
greedy never picks it: whatever the temperature or seed, the answer is a prefix of a
valid document at every step, and a complete one when it ends.  The mask goes in
through the sampler's existing seam (`Sampler(config, logit_processor=p)`), before
the penalties and the temperature, so every sampling stage works on allowed tokens
only.

    factory = compile_response_format({"type": "json_schema",
                                        "json_schema": {"schema": schema}}, tokenizer)
    sampler = Sampler(config, logit_processor=factory.processor())   # one per answer

The grammar engine: llguidance, not xgrammar.
  * Dependencies.  `llguidance` (1.9.1) is one abi3 Rust wheel with no Python
    dependencies (7.7 MB installed) and a numpy path (`llguidance.numpy`: the mask
    is written straight into an int32 bitmask array).  `pip install --dry-run
    xgrammar` (0.2.9) would install torch, triton, transformers, pydantic and 18
    CUDA/NVIDIA wheels: gigabytes for an engine whose point is numpy + numba on a
    CPU.
  * Tokenizer.  llguidance takes the vocabulary as bytes per id plus the special
    ids, so it is built from the engine's own `Tokenizer.token_bytes` (no HF
    tokenizer, no download).  xgrammar's `TokenizerInfo` could take a vocabulary
    list too; the dependency weight decides, not this.
  * Errors.  An unsupported or invalid schema comes back as a sentence
    (`LLMatcher.validate_grammar`: "look-around ... is not supported", "Unknown
    format: foo", "Pointer '/nope' does not exist"), which is what a 400 answer needs.
  * Speed.  It computes each mask on the fly over a token trie, with nothing to
    precompile per grammar: far under a decode step per token (below), so speed does
    not separate the two here.

Measured on the default model (151,936 ids; the figures, the machine and the date:
docs/BENCHMARKS.md#grammar-masks):
  * building the `LLTokenizer` from the engine's tokenizer (a token trie over 151,936
    byte strings plus the mask "slices") takes most of a second, hence `lltokenizer()`
    caches it per tokenizer object: the first structured request of a model pays it
    once;
  * compiling a response_format (schema -> grammar, `validate_grammar`, one pristine
    matcher) takes milliseconds; `Factory.processor()` deep-copies the pristine
    matcher in microseconds;
  * one mask, over a whole answer, the whole processor call included (feed the sampled
    token, mask, unpack the bitmask with numpy, write -inf), is a small fraction of a
    decode step of the same model: the mask costs a couple of percent of a token (and
    in a run under load, grammar and no grammar measured the same).

End of the answer.  llguidance reports that the grammar is complete in two ways:
`is_accepting()` (the text so far is a whole document) and `is_stopped()` (nothing
but end-of-sequence can follow: after the closing brace of a top-level object).
When stopped, the processor allows only the tokenizer's end-of-turn ids (those
`chat.ChatFormat` stops on: `<|im_end|>`, `<|endoftext|>` for Qwen), so generation
ends by itself.  When accepting but not stopped (a top-level number can still grow a
digit) the end-of-turn ids are allowed *beside* the grammar's tokens; forcing the end
there would cut every top-level integer to one digit, since Qwen spells digits one
token each.  While the document is incomplete the end-of-turn ids are masked: the
answer cannot stop early, only hit `max_tokens`.

Whitespace.  JSON lets any amount of whitespace sit between tokens, and llguidance's
default allows it (`{` then any number of newlines is a valid prefix): a sampled
answer from a small model could spend its whole budget there, a valid prefix that
never ends.  The grammar here allows what pretty-printing needs and no more,
llama.cpp's `space` rule (common/json-schema-to-grammar.cpp, `SPACE_RULE`): between
two JSON tokens, nothing, one space, or one or two newlines followed by at most 20
spaces or tabs (`WHITESPACE_PATTERN`).
"""

from __future__ import annotations

import json
import threading
import weakref
from typing import Sequence

import numpy as np

from .chat_template import end_of_turn_ids
from .errors import FucinaError

__all__ = ["GrammarError", "Factory", "GrammarProcessor", "compile_response_format",
           "compile_json_schema", "lark", "lltokenizer", "stop_ids"]

# llama.cpp's `SPACE_RULE` in json-schema-to-grammar: | " " | "\n"{1,2} [ \t]{0,20}.
WHITESPACE_PATTERN = r"(?:[ ]?|\n{1,2}[ \t]{0,20})"
_JSON_OPTIONS = {"whitespace_pattern": WHITESPACE_PATTERN}

# `{"type": "json_object"}`: any JSON object (OpenAI's JSON mode).
JSON_OBJECT_SCHEMA = {"type": "object"}


class GrammarError(FucinaError, ValueError):
    """A response_format that is malformed, or a schema the grammar engine rejects
    (the message carries llguidance's reason), or a token fed to a processor that
    its grammar does not allow."""


def _llg():
    try:
        import llguidance
        import llguidance.numpy  # noqa: F401  (the bitmask helpers)
    except ImportError as e:  # pragma: no cover - pinned in requirements.txt
        raise GrammarError("structured output needs the llguidance package "
                           "(pip install -r requirements.txt)") from e
    return llguidance


# --- the tokenizer llguidance sees ------------------------------------------------------

class _TokenizerView:
    """What `llguidance.LLTokenizer` reads from a Python tokenizer (the attributes
    of its `TokenizerWrapper`), taken from the engine's `Tokenizer`: the bytes each
    id spells, the special ids (control, user-defined and unknown markers: llguidance
    prefixes them with its 0xFF marker so no text ever spells them), the end id, and
    an `encode` for the few strings llguidance tokenizes itself."""

    is_tokenizer_wrapper = True

    def __init__(self, tokenizer, eos_id: int):
        from .tokenizer import TokenType
        types = np.asarray(tokenizer.token_types)
        special = ((types == TokenType.CONTROL) | (types == TokenType.USER_DEFINED)
                   | (types == TokenType.UNKNOWN))
        self.tokens = list(tokenizer.token_bytes)
        self.special_token_ids = np.flatnonzero(special).tolist()
        self.eos_token_id = int(eos_id)
        self.bos_token_id = tokenizer.bos_id
        self._encode = tokenizer.encode_raw

    def __call__(self, data):
        return list(self._encode(data, special=False))


def stop_ids(tokenizer) -> frozenset[int]:
    """The ids that end a turn: exactly the ones `Conversation` stops on."""
    ids = end_of_turn_ids(tokenizer)
    if not ids:
        raise GrammarError("this tokenizer has no end-of-turn token: a constrained "
                           "answer could never end")
    return ids


_cache_lock = threading.Lock()
_cache: dict[int, tuple[weakref.ref, object, frozenset[int]]] = {}


def lltokenizer(tokenizer):
    """`(LLTokenizer, stop ids)` for the engine's `tokenizer`, built once per
    tokenizer object (~0.7 s for Qwen's 151,936 ids) and kept while it lives."""
    key = id(tokenizer)
    with _cache_lock:
        hit = _cache.get(key)
        if hit is not None and hit[0]() is tokenizer:
            return hit[1], hit[2]
        llg = _llg()
        stops = stop_ids(tokenizer)
        eos = min(tokenizer.eot_ids) if tokenizer.eot_ids else min(stops)
        try:
            llt = llg.LLTokenizer(_TokenizerView(tokenizer, eos),
                                  n_vocab=len(tokenizer.token_bytes))
        except ValueError as e:
            raise GrammarError(f"cannot build the grammar engine's view of this "
                               f"vocabulary: {e}") from e
        ref = weakref.ref(tokenizer, lambda _r, k=key: _cache.pop(k, None))
        _cache[key] = (ref, llt, stops)
        return llt, stops


# --- compiling ------------------------------------------------------------------------

class Factory:
    """A compiled grammar for one tokenizer; `processor()` gives each answer its own
    matcher state.  Cheap to keep (one pristine matcher), cheap to use (~10 us per
    processor)."""

    def __init__(self, grammar: str, tokenizer, *, description: str = "grammar"):
        llg = _llg()
        self.tokenizer = tokenizer
        self.grammar = grammar
        self.description = description
        self.lltokenizer, self.stop_ids = lltokenizer(tokenizer)
        why = llg.LLMatcher.validate_grammar(grammar, self.lltokenizer)
        if why:
            raise GrammarError(f"{description}: {why}")
        self._pristine = llg.LLMatcher(self.lltokenizer, grammar, log_level=0)
        if self._pristine.is_error():
            raise GrammarError(f"{description}: {self._pristine.get_error()}")

    def processor(self, *, after: int | None = None) -> "GrammarProcessor":
        """A fresh logit processor for one answer (stateful: never share it).

        `after`: a token id (Qwen3's `</think>`) before which the answer is free: the
        grammar constrains what follows it, so a thinking model thinks in prose and
        answers in JSON.  None: the grammar holds from the first answer token."""
        return GrammarProcessor(self._pristine.deep_copy(), self, after=after)

    def __repr__(self):
        return f"Factory({self.description})"


def lark(source: str) -> str:
    """A grammar written in llguidance's Lark dialect (`%json {schema}` for a JSON
    value, `<[id]>` for one token by id) -> the grammar `Factory` takes."""
    try:
        return _llg().grammar_from("lark", source)
    except (ValueError, TypeError) as e:
        raise GrammarError(f"grammar: {e}") from e


def compile_json_schema(schema, tokenizer, *, description: str | None = None) -> Factory:
    """A `Factory` for JSON documents that validate against `schema` (a dict, a
    bool, or its JSON text)."""
    llg = _llg()
    what = description or "json_schema"
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise GrammarError(f"{what}: the schema is not valid JSON: {e}") from e
    if schema is True:
        schema = {}
    if not isinstance(schema, dict):
        raise GrammarError(f"{what}: a schema must be a JSON object (or true), got "
                           f"{type(schema).__name__}")
    try:
        grammar = llg.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
    except (ValueError, TypeError) as e:
        raise GrammarError(f"{what}: {e}") from e
    return Factory(grammar, tokenizer, description=what)


def compile_response_format(response_format, tokenizer) -> Factory | None:
    """OpenAI's `response_format` -> a `Factory`, or None for plain text.

    `{"type": "text"}` -> None; `{"type": "json_object"}` -> any JSON object;
    `{"type": "json_schema", "json_schema": {"schema": {...}, "name": ...,
    "strict": ...}}` -> that schema (strict or not, the output always follows it;
    no schema at all means any JSON value, llama.cpp's reading).  llama.cpp's
    extension `{"type": "json_object", "schema": {...}}` is that schema too.
    Anything else, or a schema llguidance cannot compile, raises `GrammarError`
    with the reason."""
    if response_format is None:
        return None
    if not isinstance(response_format, dict):
        raise GrammarError(f"response_format must be an object, got "
                           f"{type(response_format).__name__}")
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        schema = response_format.get("schema", JSON_OBJECT_SCHEMA)
        return compile_json_schema(schema, tokenizer,
                                   description="response_format json_object")
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict):
            raise GrammarError("response_format.json_schema must be an object with a "
                               "'schema' (got "
                               f"{'nothing' if spec is None else type(spec).__name__})")
        name = spec.get("name")
        if name is not None and not isinstance(name, str):
            raise GrammarError("response_format.json_schema.name must be a string")
        strict = spec.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise GrammarError("response_format.json_schema.strict must be a boolean")
        schema = spec.get("schema", {})
        label = f"response_format json_schema {name!r}" if name else \
            "response_format json_schema"
        return compile_json_schema(schema, tokenizer, description=label)
    raise GrammarError(f"response_format.type must be 'text', 'json_object' or "
                       f"'json_schema', got {kind!r}")


# --- the processor ----------------------------------------------------------------------

class GrammarProcessor:
    """`p(logits, history) -> logits` with the grammar's disallowed tokens at -inf.

    The first call remembers `len(history)` as the prompt; each later call feeds the
    ids appended since (the sampled ones) to the matcher, then masks.  So the same
    processor serves `Sampler.next` in any decode loop (`Conversation`, a batch
    scheduler) without being told which tokens were chosen.  With `after` set, the
    logits pass untouched until that id has been sampled.  A fed id that the
    grammar does not allow (someone else picked it) raises `GrammarError`; an
    end-of-turn id ends the answer (later calls allow only end-of-turn ids)."""

    def __init__(self, matcher, factory: Factory, *, after: int | None = None):
        llg = _llg()
        self._after = None if after is None else int(after)   # free until this id
        self._matcher = matcher
        self._factory = factory
        self._fill = llg.numpy.fill_next_token_bitmask
        n = factory.lltokenizer.vocab_size
        self._n = n
        self._bits = llg.numpy.allocate_token_bitmask(1, n)          # [1, ceil(n/32)]
        self._stops = np.array(sorted(factory.stop_ids), dtype=np.int64)
        self._seen: int | None = None      # history length already fed
        self._ended = False                # an end-of-turn id was fed
        self.last_allowed: np.ndarray | None = None   # [n] bool, the latest mask

    # what the server may ask between steps
    def is_accepting(self) -> bool:
        """Is the text so far a complete document?"""
        return self._after is None and (self._ended or self._matcher.is_accepting())

    def is_finished(self) -> bool:
        """Nothing but an end-of-turn token can follow (or one was already fed)."""
        return self._after is None and (self._ended or self._matcher.is_stopped())

    def feed(self, ids: Sequence[int]) -> None:
        """Advance the matcher over sampled ids (what `__call__` does by itself)."""
        for tid in ids:
            tid = int(tid)
            if self._after is not None:         # still free (thinking)
                if tid == self._after:
                    self._after = None
                continue
            if self._ended:
                raise GrammarError(f"token {tid} after the end of a constrained answer")
            if tid in self._factory.stop_ids:
                if not self._matcher.is_accepting():
                    raise GrammarError(
                        f"end-of-turn token {tid} before the {self._factory.description} "
                        f"document is complete")
                self._ended = True
                continue
            if not 0 <= tid < self._n:
                raise GrammarError(f"token {tid} is outside the vocabulary ({self._n})")
            if not self._matcher.consume_token(tid):
                raise GrammarError(f"{self._factory.description}: token {tid} "
                                   f"({self._factory.tokenizer.token_bytes[tid]!r}) is "
                                   f"outside the grammar: {self._matcher.get_error()}")

    def allowed(self) -> np.ndarray:
        """`[vocab]` bool: the ids the next token may be, end-of-turn ids included."""
        m = self._matcher
        if self._ended or m.is_stopped():
            ok = np.zeros(self._n, dtype=bool)
            ok[self._stops] = True
        else:
            self._fill(m, self._bits)
            if m.is_error():
                raise GrammarError(f"{self._factory.description}: {m.get_error()}")
            ok = np.unpackbits(self._bits[0].view(np.uint8), bitorder="little",
                               count=self._n).view(bool)               # [n]
            ok[self._stops] = m.is_accepting()
        self.last_allowed = ok
        return ok

    def __call__(self, logits: np.ndarray, history: Sequence[int]) -> np.ndarray:
        n_hist = len(history)
        if self._seen is None:
            self._seen = n_hist                 # the prompt: not the grammar's business
        elif n_hist < self._seen:
            raise GrammarError(f"the history shrank from {self._seen} to {n_hist} "
                               f"tokens: a grammar processor serves one answer, in order")
        elif n_hist > self._seen:
            self.feed(history[self._seen:])
            self._seen = n_hist
        if self._after is not None:
            self.last_allowed = None
            return logits
        ok = self.allowed()
        x = np.asarray(logits)
        n = x.shape[0]
        if n > self._n:                         # ids past the tokenizer's: never allowed
            ok = np.concatenate([ok, np.zeros(n - self._n, dtype=bool)])
        elif n < self._n:
            if ok[n:].any() and not ok[:n].any():
                raise GrammarError(f"the grammar allows only ids beyond the "
                                   f"{n} logits")
            ok = ok[:n]
        return np.where(ok, x, np.float32(-np.inf)).astype(x.dtype, copy=False)
