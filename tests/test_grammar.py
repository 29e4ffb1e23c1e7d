"""Structured output (fucina_course/grammar.py) against independent references.

* The answers of the default model under a schema, greedy and sampled at T = 1 with
  several seeds, must parse with `json.loads` and validate with `jsonschema` (a
  validator that shares no code with llguidance).  They run as one
  `Conversation.send_batch` (one weight read per step for all five answers): the
  way the server decodes concurrent requests, and five answers for the time of ~2.
* A model-free random walk: uniform random scores, so every allowed token is as
  likely as any other; if a mask ever let through a token that leads nowhere, the
  walk would end in a document that fails `jsonschema` (or the matcher would error).
* Masks against llguidance's own per-token check: at each step of a real answer,
  a fresh matcher fed the same prefix must accept exactly the ids the processor
  left finite (sampled both ways), which pins the bitmask's bit order, the vocabulary
  view (special tokens) and the end-of-turn rule.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

jsonschema = pytest.importorskip("jsonschema")
llguidance = pytest.importorskip("llguidance")

from fucina_course.errors import FucinaError  # noqa: E402
from fucina_course.grammar import (GrammarError, compile_response_format,  # noqa: E402
                                   lltokenizer)
from fucina_course.sampler import Sampler, SamplerConfig  # noqa: E402

# Bounded on purpose (maxLength, maximum, maxItems): every valid document is short, so
# an answer fits in MAX_TOKENS and the random walk ends.
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 10},
                 "maxItems": 2},
    },
    "required": ["name", "age", "role", "tags"],
    "additionalProperties": False,
}
PERSON_FORMAT = {"type": "json_schema",
                 "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
MAX_TOKENS = 72


@pytest.fixture(scope="module")
def model(coder_model):
    return coder_model


@pytest.fixture(scope="module")
def tok(model):
    return model.tokenizer


@pytest.fixture(scope="module")
def person(tok):
    return compile_response_format(PERSON_FORMAT, tok)


class Recording:
    """Wraps a processor: keeps (history length, allowed mask) of every call."""

    def __init__(self, p):
        self.p, self.steps = p, []

    def __call__(self, logits, history):
        out = self.p(logits, history)
        self.steps.append((len(history), np.isfinite(out)))
        return out


@pytest.fixture(scope="module")
def answers(model, person):
    """Five answers decoded together: schema greedy, schema at T = 1 (seeds 1-3,
    top-k/top-p/min-p off: any allowed token may come), json_object greedy."""
    from fucina_course.chat import Conversation

    anything = compile_response_format({"type": "json_object"}, model.tokenizer)
    open_t1 = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    runs = [("schema", person, SamplerConfig.greedy(seed=0)),
            *[("schema", person, SamplerConfig(seed=s, **open_t1)) for s in (1, 2, 3)],
            ("object", anything, SamplerConfig.greedy(seed=0))]
    convs, recs = [], []
    for _, factory, cfg in runs:
        rec = Recording(factory.processor())
        recs.append(rec)
        convs.append(Conversation(model, system="You answer in JSON.", capacity=256,
                                  max_response_tokens=MAX_TOKENS,
                                  sampler=Sampler(cfg, logit_processor=rec)))
    questions = ["Invent a user of a web shop: name, age, role and tags."] * 4 + \
                ["Give the capital and population of France as a JSON object."]
    replies = Conversation.send_batch(convs, questions)
    return [(kind, cfg, reply, rec) for (kind, _, cfg), reply, rec
            in zip(runs, replies, recs)]


# --- the model's answers ------------------------------------------------------------------

def test_schema_answers_parse_and_validate(answers):
    for kind, cfg, reply, _ in answers:
        if kind != "schema":
            continue
        assert reply.stop_reason == "end", (cfg, reply.text)     # ended by itself
        doc = json.loads(reply.text)
        jsonschema.validate(doc, PERSON)


def test_json_object_answer_is_an_object(answers):
    (_, _, reply, _), = [a for a in answers if a[0] == "object"]
    assert reply.stop_reason == "end", reply.text
    assert isinstance(json.loads(reply.text), dict)


def test_sampled_answers_differ_from_greedy(answers):
    """T = 1 really sampled (else the seeds test nothing)."""
    texts = {reply.text for kind, _, reply, _ in answers if kind == "schema"}
    assert len(texts) >= 2


def test_masks_equal_llguidance_per_token_check(answers, person, tok):
    """At every step, a fresh matcher fed the answer so far accepts exactly the ids
    the processor left finite (a sample of each), end-of-turn ids only at the end."""
    rng = np.random.default_rng(0)
    stops = sorted(person.stop_ids)
    for kind, _, reply, rec in answers[:4]:             # the schema answers
        prompt_len = rec.steps[0][0]
        for n_hist, allowed in rec.steps:
            prefix = reply.ids[:n_hist - prompt_len]
            m = llguidance.LLMatcher(person.lltokenizer, person.grammar, log_level=0)
            assert m.consume_tokens(prefix)
            ok_ids = np.flatnonzero(allowed[:len(tok.token_bytes)])
            bad_ids = np.flatnonzero(~allowed)
            if m.is_stopped():       # the document is complete: only end-of-turn
                assert ok_ids.tolist() == stops
                continue
            assert not allowed[stops].any()     # no early end in an object schema
            for ids, want in ((ok_ids, 1), (bad_ids, 0)):
                for t in rng.choice(ids, size=min(64, ids.size), replace=False):
                    if t in stops:
                        continue
                    assert m.validate_tokens([int(t)]) == want, (prefix, int(t))


# --- model-free: the grammar alone ----------------------------------------------------------

def random_walk(factory, seed: int, vocab: int, max_steps: int = 400) -> list[int]:
    """Sample uniformly among the allowed tokens until an end-of-turn id."""
    rng = np.random.default_rng(seed)
    p = factory.processor()
    history = [0]                                   # a one-token "prompt"
    for _ in range(max_steps):
        x = p(rng.random(vocab, dtype=np.float32), history)
        tid = int(np.argmax(x))
        if tid in factory.stop_ids:
            assert p.is_finished() or p.is_accepting()
            return history[1:]
        history.append(tid)
    raise AssertionError("the random walk did not end")


def test_random_walks_validate(person, tok):
    vocab = len(tok.token_bytes)
    for seed in range(6):
        ids = random_walk(person, seed, vocab)
        jsonschema.validate(json.loads(tok.decode(ids)), PERSON)


def test_top_level_integer_is_not_cut_to_one_digit(tok):
    """Accepting but not finished: a number may still grow (Qwen spells digits one
    token each), so end-of-turn is allowed beside the digits, not instead of them."""
    f = compile_response_format({"type": "json_schema", "json_schema": {
        "schema": {"type": "integer", "minimum": 100, "maximum": 999}}}, tok)
    p = f.processor()
    vocab = len(tok.token_bytes)
    x = p(np.zeros(vocab, np.float32), [0])
    assert not np.isfinite(x[sorted(f.stop_ids)]).any()   # "" is not an integer
    digits = [tok.token_id(d) for d in "123"]
    for i, d in enumerate(digits):
        x = p(np.zeros(vocab, np.float32), [0] + digits[:i + 1])
    assert np.isfinite(x[sorted(f.stop_ids)]).all()       # "123" is complete
    assert p.is_accepting()
    assert p.is_finished() or np.isfinite(x).sum() == len(f.stop_ids)
    ids = random_walk(f, 7, vocab)
    assert 100 <= json.loads(tok.decode(ids)) <= 999


def test_whitespace_is_bounded(tok):
    """Pretty-printing passes; a run of blank lines (a never-ending valid prefix
    under JSON's own rule) does not."""
    f = compile_response_format({"type": "json_object"}, tok)

    def valid_prefix(text):
        m = llguidance.LLMatcher(f.lltokenizer, f.grammar, log_level=0)
        ids = tok.encode_raw(text)
        return m.validate_tokens(ids) == len(ids)

    assert valid_prefix('{\n    "a": [1, 2],\n\n    "b": {"c": null}\n}')
    assert valid_prefix('{"a":1}')
    assert not valid_prefix('{\n\n\n\n"a": 1}')
    assert not valid_prefix('{\n' + ' ' * 40 + '"a": 1}')


def test_processor_state(person, tok):
    vocab = len(tok.token_bytes)
    p = person.processor()
    p(np.zeros(vocab, np.float32), [1, 2, 3])
    with pytest.raises(GrammarError, match="shrank"):
        p(np.zeros(vocab, np.float32), [1, 2])
    q = person.processor()
    q(np.zeros(vocab, np.float32), [1])
    with pytest.raises(GrammarError, match="outside the grammar"):
        q(np.zeros(vocab, np.float32), [1, tok.token_id("hello")])   # must open '{'
    r = person.processor()
    x = r(np.zeros(vocab + 5, np.float32), [1])    # logits longer than the vocabulary
    assert x.shape == (vocab + 5,) and not np.isfinite(x[vocab:]).any()


def test_lltokenizer_is_the_engines_and_cached(tok):
    llt, stops = lltokenizer(tok)
    assert lltokenizer(tok)[0] is llt
    assert stops == {tok.token_id("<|im_end|>"), tok.token_id("<|endoftext|>")}
    for text in ['{"a": [1, 2.5e-3, "x\\u00e9"]}', "  \n\tCafé — 東京 😀", "<|im_end|>"]:
        assert llt.tokenize_str(text) == tok.encode_raw(text, special=False)
    assert llt.is_special_token(tok.token_id("<|im_end|>"))
    assert not llt.is_special_token(tok.token_id("{"))


# --- what the server turns into a 400 ---------------------------------------------------------

def test_text_is_no_grammar(tok):
    assert compile_response_format({"type": "text"}, tok) is None
    assert compile_response_format(None, tok) is None


@pytest.mark.parametrize("schema, reason", [
    ({"type": "string", "pattern": "(?=a)b"}, "look-around"),
    ({"type": "objekt"}, "objekt"),
    ({"type": "string", "format": "no-such-format"}, "no-such-format"),
    ({"$ref": "#/definitions/missing"}, "missing"),
])
def test_unsupported_schema_raises_with_the_reason(tok, schema, reason):
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    with pytest.raises(GrammarError, match=reason) as err:
        compile_response_format(fmt, tok)
    assert isinstance(err.value, FucinaError) and isinstance(err.value, ValueError)


@pytest.mark.parametrize("fmt", [
    "json", ["json_object"], {}, {"type": "xml"}, {"type": None},
    {"type": "json_schema"}, {"type": "json_schema", "json_schema": "{}"},
    {"type": "json_schema", "json_schema": {"schema": 3}},
    {"type": "json_schema", "json_schema": {"schema": "{not json"}},
    {"type": "json_schema", "json_schema": {"name": 5, "schema": {}}},
    {"type": "json_schema", "json_schema": {"strict": "yes", "schema": {}}},
])
def test_malformed_response_format_raises(tok, fmt):
    with pytest.raises(GrammarError):
        compile_response_format(fmt, tok)


def test_free_until_after_token(person, tok):
    """`processor(after=</think>-like id)`: untouched logits while thinking, the
    grammar from the token after it."""
    vocab = len(tok.token_bytes)
    close = tok.token_id("<|im_start|>")       # any special id stands in for </think>
    p = person.processor(after=close)
    x = np.zeros(vocab, np.float32)
    hist = [0]
    assert np.isfinite(p(x.copy(), hist)).all()
    hist += [tok.token_id("hello")]
    assert np.isfinite(p(x.copy(), hist)).all() and not p.is_accepting()
    hist += [close]
    out = p(x.copy(), hist)
    assert np.isfinite(out).sum() < vocab and np.isfinite(out[tok.token_id("{")])
    assert not np.isfinite(out[tok.token_id("hello")])
