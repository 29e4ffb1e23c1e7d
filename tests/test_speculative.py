"""Speculative decoding (fucina_course/speculative.py): the same tokens, fewer steps.

The oracle of every exactness test is plain decoding by the same engine
(`Model.generate`, a `Conversation` without a speculator): speculation promises
the *same* tokens, so plain decoding is the reference, and the verify rows are
checked bit for bit against plain decode steps.  The sampling rule is checked
statistically against the exact distribution computed from the model's own
probabilities, with a bound a wrong rule fails (the negative controls).
"""

from __future__ import annotations

import json
import math
from collections import Counter

import numpy as np
import pytest

from fucina_course.chat import Conversation
from fucina_course.errors import FucinaError
from fucina_course.model import Model
from fucina_course.sampler import Distribution, Sampler, SamplerConfig
from fucina_course.commands import make_speculator
from fucina_course.speculative import (Draft, DraftModel, PromptLookup, Speculator,
                                       accept_sampled, verify_step)
from fucina_course.synth import TINY_QWEN3, cached_synthetic, with_format

CODE = '''def mean(values):
    """The arithmetic mean of a non-empty list."""
    total = 0
    for value in values:
        total += value
    return total / len(values)
'''


@pytest.fixture(scope="module")
def tiny():
    return Model.load(cached_synthetic(TINY_QWEN3))


@pytest.fixture(scope="module")
def tiny_q4():
    """The tiny weights rounded to Q4_0: a draft model whose distribution is near
    the target's but not equal (at T = 1, top-k 4, the first prediction shares one
    of its four candidates: the rule both accepts and rejects)."""
    return Model.load(cached_synthetic(with_format(TINY_QWEN3, "Q4_0")))


class Fixed:
    """A drafter that proposes what it is told: `guesses(tokens)` -> ids."""

    name = "fixed"

    def __init__(self, guesses):
        self.guesses = guesses

    def propose(self, tokens, limit):
        return Draft(list(self.guesses(tokens))[:limit])


def _edit_prompt(model) -> list[int]:
    from fucina_course.chat import render_prompt

    return model.tokenizer.encode_raw(render_prompt(
        model.tokenizer, "Rename `total` to `acc` in this function; reply with the "
        "code only.\n\n```python\n" + CODE + "```"))


# --- the verify step is exact -------------------------------------------------------

@pytest.mark.parametrize("cache_type", ["f16", "q8_0"])
def test_verify_rows_equal_plain_decode_steps_bit_for_bit(coder_model, cache_type):
    m = coder_model
    ids = m.tokenizer.encode(CODE)
    cache = m.new_cache(256, cache_type)
    m.forward_step(ids[:20], 0, cache)
    plain = [m.forward_step([t], cache.len, cache) for t in ids[20:29]]
    k_plain = [k[20:29].copy() for k in cache.k]
    cache.truncate(20)
    rows = verify_step(m, ids[20:29], cache)
    for a, b in zip(plain, rows):
        assert np.array_equal(a, b)
    for a, b in zip(k_plain, cache.k):
        assert np.array_equal(a, b[20:29])


# --- greedy: token for token --------------------------------------------------------

@pytest.mark.parametrize("draft_max", [1, 3, 8])
@pytest.mark.parametrize("cache_type", ["f16", "q8_0"])
def test_greedy_lookup_equals_plain_on_the_default_model(coder_model, draft_max,
                                                         cache_type):
    m = coder_model
    ids = _edit_prompt(m)
    cache = m.new_cache(len(ids) + 40, cache_type)
    plain = m.generate(ids, 40, cache=cache)
    spec = Speculator(PromptLookup(), draft_max)
    cache = m.new_cache(len(ids) + 40, cache_type)
    fast = m.generate(ids, 40, speculator=spec, cache=cache)
    assert fast == plain
    assert cache.len == len(ids) + len(fast) - 1      # as plain: the last not fed
    assert spec.stats.accepted > 0            # the edit copies its prompt
    assert spec.stats.steps < len(fast)


@pytest.mark.parametrize("text", ["The capital of France is", "1, 2, 3, 1, 2, 3, 1, 2",
                                  "def f(x):\n    return x\n\ndef g(x):\n    return"])
@pytest.mark.parametrize("draft_max", [2, 5])
def test_greedy_lookup_equals_plain_on_a_synthetic_model(tiny, text, draft_max):
    ids = tiny.tokenizer.encode(text)
    plain = tiny.generate(ids, 48)
    spec = Speculator(PromptLookup(ngram_min=1), draft_max)
    assert tiny.generate(ids, 48, speculator=spec) == plain
    assert spec.stats.drafted > 0


def test_rejection_at_the_first_guess_changes_nothing(tiny):
    ids = tiny.tokenizer.encode("The capital of France is")
    plain = tiny.generate(ids, 24)
    wrong = Fixed(lambda tokens: [(tiny.generate(tokens, 1)[0] + 1) % 4096] * 4)
    spec = Speculator(wrong, 4)
    assert tiny.generate(ids, 24, speculator=spec) == plain
    assert spec.stats.accepted == 0 and spec.stats.drafted > 0


def test_guesses_past_the_token_limit_and_the_end_marker_are_cut(tiny):
    ids = tiny.tokenizer.encode("Once upon a time")
    plain = tiny.generate(ids, 60, stop_ids=set())
    n = len(ids)

    def oracle(tokens):          # always right, and always more than allowed
        return plain[len(tokens) - n:] + [0] * 20

    for limit in (1, 7, 13):
        spec = Speculator(Fixed(oracle), 8)
        cache = tiny.new_cache(n + 60)
        out = tiny.generate(ids, limit, speculator=spec, stop_ids=set(), cache=cache)
        assert out == plain[:limit]
        assert cache.len == n + limit - 1     # the last token is never fed
    stop = plain[9]                           # pretend the 10th token ends the turn
    spec = Speculator(Fixed(oracle), 8)
    out = tiny.generate(ids, 60, speculator=spec, stop_ids={stop})
    assert out == plain[:plain.index(stop) + 1]


def test_guesses_never_run_past_the_context(tiny):
    ids = tiny.tokenizer.encode("Once upon a time")
    n = len(ids)
    plain = tiny.generate(ids, 30, stop_ids=set(), cache=tiny.new_cache(n + 10))
    assert len(plain) == 11                   # the cache filled up
    spec = Speculator(Fixed(lambda t: [1, 2, 3, 4, 5, 6, 7, 8] * 3), 8)
    cache = tiny.new_cache(n + 10)
    assert tiny.generate(ids, 30, speculator=spec, stop_ids=set(), cache=cache) == plain
    assert cache.len == cache.capacity


# --- the conversation: same tokens, same cache --------------------------------------

@pytest.mark.parametrize("config", [SamplerConfig.greedy(),
                                    SamplerConfig(temperature=1.0, seed=3),
                                    SamplerConfig(temperature=0.8, top_k=40, seed=9,
                                                  repeat_penalty=1.1)])
def test_a_seeded_conversation_answers_the_same_with_lookup(coder_model, config):
    q = ("Copy this list exactly, one per line: apple, banana, cherry, date, fig, "
         "grape, kiwi, lemon.")
    plain = Conversation(coder_model, sampler=config, max_response_tokens=40)
    a = plain.send(q)
    spec = Speculator(PromptLookup(), 6)
    fast = Conversation(coder_model, sampler=config, max_response_tokens=40,
                        speculator=spec)
    b = fast.send(q)
    assert b.ids == a.ids and b.text == a.text
    assert b.drafted == spec.stats.drafted and b.accepted == spec.stats.accepted
    assert fast.sampler.draws == plain.sampler.draws      # one draw per token
    # the cache holds exactly the accepted tokens: the same bits as plain decoding's
    assert fast.tokens == plain.tokens and fast.cache.len == len(fast.tokens)
    n = fast.cache.len
    for ka, kb, va, vb in zip(plain.cache.k, fast.cache.k, plain.cache.v, fast.cache.v):
        assert np.array_equal(ka[:n], kb[:n]) and np.array_equal(va[:n], vb[:n])
    # and the conversation goes on from it as plain decoding does
    assert fast.send("Now reverse it.").ids == plain.send("Now reverse it.").ids


def test_stop_strings_and_max_tokens_hold_under_speculation(coder_model):
    q = "Count from 1 to 30, separated by commas."
    for kwargs in (dict(max_response_tokens=9), dict(stop=["12"])):
        a = Conversation(coder_model, sampler=SamplerConfig.greedy(), **kwargs).send(q)
        b = Conversation(coder_model, sampler=SamplerConfig.greedy(),
                         speculator=Speculator(PromptLookup(ngram_min=1), 8),
                         **kwargs).send(q)
        assert (b.ids, b.text, b.stop_reason) == (a.ids, a.text, a.stop_reason)


def test_accept_refuses_a_token_that_was_not_verified(tiny):
    conv = Conversation(tiny, sampler=SamplerConfig.greedy())
    conv.extend(tiny.tokenizer.encode("Hello"))
    conv.verify([5, 6, 7])
    conv.accept(6)
    with pytest.raises(FucinaError):
        conv.accept(9)
    conv.extend([8])                  # a new step forgets the pending guess 7
    with pytest.raises(FucinaError):
        conv.accept(7)
    assert conv.cache.len == len(conv.tokens)


# --- drafters -----------------------------------------------------------------------

def test_prompt_lookup_copies_after_the_most_recent_longest_match():
    look = PromptLookup(ngram_max=3, ngram_min=1)
    #          0  1  2  3  4  5  6  7  8  9
    tokens = [1, 2, 3, 9, 1, 2, 3, 4, 5, 2, 3]
    assert look.propose(tokens, 3).ids == [4, 5, 2]      # "2 3" last seen at 5..6
    assert look.propose([1, 2, 3, 1, 2, 3], 10).ids == [1, 2, 3]   # "1 2 3" at 0
    assert look.propose([7, 8, 9], 4).ids == []          # nothing repeats
    assert PromptLookup(ngram_min=2).propose([5, 1, 6, 1], 4).ids == []
    with pytest.raises(FucinaError):
        PromptLookup(ngram_max=1, ngram_min=2)


def test_a_greedy_draft_model_reproduces_plain_decoding(tiny, tiny_q4):
    ids = tiny.tokenizer.encode("The capital of France is")
    plain = tiny.generate(ids, 32)
    for drafter in (DraftModel(tiny_q4, tiny.config.vocab_size),
                    DraftModel(tiny, tiny.config.vocab_size)):
        spec = Speculator(drafter, 4)
        assert tiny.generate(ids, 32, speculator=spec) == plain
    assert spec.stats.acceptance == 1.0       # the target drafting for itself


def test_make_speculator_spells_the_cli_options(tiny, tmp_path):
    assert make_speculator(None, tiny) is None
    assert isinstance(make_speculator("lookup", tiny).drafter, PromptLookup)
    assert make_speculator("lookup", tiny, draft_max=3).draft_max == 3
    with pytest.raises(FucinaError, match="lookup"):
        make_speculator("ngram", tiny)
    with pytest.raises(FucinaError, match="at least 1"):
        make_speculator("lookup", tiny, draft_max=0)
    other = cached_synthetic(with_format(TINY_QWEN3, "Q8_0", vocab_size=1024))
    with pytest.raises(FucinaError, match="vocabulary"):
        make_speculator(f"draft:{other}", tiny)


# --- sampling: the rule keeps the distribution --------------------------------------

def _chi2_critical(dof: int, z: float = 3.719) -> float:
    """The chi-square value exceeded with probability ~1e-4 (z: the normal
    quantile), by the Wilson-Hilferty approximation (no scipy here)."""
    c = 2.0 / (9.0 * dof)
    return dof * (1.0 - c + z * math.sqrt(c)) ** 3


def _chi2(counts: Counter, expected: dict, n: int) -> tuple[float, int]:
    """Pearson's statistic over the cells of `expected` (cells under 5 expected
    counts pooled into one), and its degrees of freedom."""
    stat, pool_o, pool_e, cells = 0.0, 0, 0.0, 0
    for key, p in expected.items():
        e = p * n
        if e < 5:
            pool_o, pool_e = pool_o + counts.get(key, 0), pool_e + e
            continue
        stat += (counts.get(key, 0) - e) ** 2 / e
        cells += 1
    outside = n - sum(counts.get(k, 0) for k in expected)   # impossible outcomes
    pool_o += outside
    if pool_e > 0:
        stat += (pool_o - pool_e) ** 2 / pool_e
        cells += 1
    elif pool_o:
        return math.inf, max(cells - 1, 1)
    return stat, cells - 1


def test_accept_sampled_keeps_the_target_distribution():
    rng = np.random.default_rng(0)
    p = Distribution(np.array([3, 1, 4, 0]), np.array([0.4, 0.3, 0.2, 0.1]))
    q = Distribution(np.array([1, 5, 3]), np.array([0.6, 0.3, 0.1]))
    n = 20000
    counts, naive = Counter(), Counter()
    for _ in range(n):
        guess = int(q.ids[np.searchsorted(np.cumsum(q.probs), rng.random())])
        tid, _ = accept_sampled(p, q, guess, rng.random(), rng.random)
        counts[tid] += 1
        naive[guess] += 1               # a wrong rule: always accept the guess
    expected = dict(zip(p.ids.tolist(), p.probs.tolist()))
    stat, dof = _chi2(counts, expected, n)
    assert stat < _chi2_critical(dof)
    bad, dof = _chi2(naive, expected, n)
    assert bad > _chi2_critical(dof)    # the bound can fail


def test_speculative_sampling_matches_plain_sampling_on_a_model(tiny, tiny_q4):
    """Joint distribution of the first two answer tokens of a seeded chat, sampled
    with a *sampled* draft model (the general rule), against the exact joint
    computed from the target's own probabilities."""
    config = SamplerConfig(temperature=1.0, top_k=4, top_p=1.0, min_p=0.0)
    conv = Conversation(tiny, sampler=config)
    text = conv.format.render([{"role": "user", "content": "Hi"}])
    ids = tiny.tokenizer.encode_raw(text)
    judge = Sampler(config.with_(seed=0))
    p1 = judge.distribution(tiny.forward_last_logits(ids), ids)
    expected = {}
    for a, pa in zip(p1.ids.tolist(), p1.probs.tolist()):
        p2 = judge.distribution(tiny.forward_last_logits(ids + [a]), ids + [a])
        for b, pb in zip(p2.ids.tolist(), p2.probs.tolist()):
            expected[(a, b)] = pa * pb
    n = 1200
    counts, drafted, accepted = Counter(), 0, 0
    draft = DraftModel(tiny_q4, tiny.config.vocab_size, sample=True, config=config,
                       capacity=64)
    spec = Speculator(draft, 2)
    for seed in range(n):
        draft.sampler = Sampler(config.with_(seed=10_000 + seed))
        conv = Conversation(tiny, sampler=config.with_(seed=seed), capacity=64,
                            max_response_tokens=2, speculator=spec)
        reply = conv.send("Hi")
        counts[tuple(reply.ids[:2])] += 1
        drafted, accepted = drafted + reply.drafted, accepted + reply.accepted
    assert 0 < accepted < drafted             # the rule both accepts and rejects
    stat, dof = _chi2(counts, expected, n)
    assert stat < _chi2_critical(dof), (stat, dof)
    # negative control: the same counts against the draft's own joint must fail
    qd = Sampler(config.with_(seed=0))
    wrong = {}
    for a, pa in zip(p1.ids.tolist(), p1.probs.tolist()):
        q2 = qd.distribution(tiny_q4.forward_last_logits(ids + [a]), ids + [a])
        for b, pb in zip(q2.ids.tolist(), q2.probs.tolist()):
            wrong[(a, b)] = pa * pb
    bad, dof = _chi2(counts, wrong, n)
    assert bad > _chi2_critical(dof)


# --- the server ---------------------------------------------------------------------

def test_a_speculating_server_answers_as_a_plain_one(coder_model):
    openai = pytest.importorskip("openai")
    jsonschema = pytest.importorskip("jsonschema")
    import httpx

    from fucina_course.server import Server

    q = ("Copy this exactly: alpha beta gamma delta epsilon zeta eta theta iota "
         "kappa lambda mu")
    schema = {"type": "object", "properties": {"words": {
        "type": "array", "items": {"type": "string"}, "maxItems": 4}},
        "required": ["words"], "additionalProperties": False}
    answers = []
    for speculator in (None, Speculator(PromptLookup(), 8)):
        with Server(coder_model, model_id="m", port=0, parallel=2, ctx=256,
                    speculator=speculator) as s:
            client = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0,
                                   timeout=120)
            got = []
            for kw in (dict(temperature=0), dict(temperature=1.0, seed=5),
                       dict(temperature=0, response_format={
                           "type": "json_schema",
                           "json_schema": {"name": "w", "schema": schema}})):
                chunks = client.chat.completions.create(
                    model="m", messages=[{"role": "user", "content": q}],
                    max_tokens=30, stream=True, **kw)
                got.append("".join(c.choices[0].delta.content or ""
                                   for c in chunks if c.choices))
            jsonschema.validate(json.loads(got[-1]), schema)
            health = httpx.get(s.url + "/health").json()
            answers.append(got)
    assert answers[0] == answers[1]
    assert health["accepted"] > 0 and health["drafted"] >= health["accepted"]


# --- the command line --------------------------------------------------------------------

def _fucina(*args):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "fucina_course", *map(str, args)],
                          capture_output=True, text=True, timeout=600)


def test_cli_generate_with_lookup_prints_the_same_text_and_its_stats(tmp_path):
    path = cached_synthetic(TINY_QWEN3)
    common = ["generate", path, "--prompt", "1, 2, 3, 1, 2, 3, 1, 2", "--gen", "40",
              "--ignore-eos"]
    plain = _fucina(*common, "--ids-out", tmp_path / "plain.txt")
    fast = _fucina(*common, "--speculate", "lookup", "--draft-max", "4", "--stats",
                   "--ids-out", tmp_path / "fast.txt")
    assert plain.returncode == 0 and fast.returncode == 0, fast.stderr
    assert fast.stdout == plain.stdout
    assert (tmp_path / "fast.txt").read_text() == (tmp_path / "plain.txt").read_text()
    assert "speculation:" in fast.stderr and "accepted" in fast.stderr


@pytest.mark.parametrize("flags, message", [
    (["--speculate", "ngram"], "--speculate must be 'lookup' or 'draft:MODEL'"),
    (["--speculate", "draft:"], "--speculate must be 'lookup' or 'draft:MODEL'"),
    (["--speculate", "lookup", "--draft-max", "0"], "--draft-max must be at least 1"),
    (["--speculate", "draft:/no/such/file.gguf"], "no/such/file.gguf"),
])
def test_cli_bad_speculation_flags_give_one_line(flags, message):
    r = _fucina("chat", cached_synthetic(TINY_QWEN3), "hello", *flags)
    assert r.returncode == 1
    assert message in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
