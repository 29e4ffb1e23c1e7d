"""The generation core (generation.py): the stop rules, what reaches the cache, and
the loop every caller drives, checked against a loop written out here step by step
with `Model.forward_step` and numpy's argmax on the synthetic Qwen3."""

from __future__ import annotations

import numpy as np
import pytest

from fucina_course.chat import Conversation
from fucina_course.errors import FucinaError
from fucina_course.generation import Decoder, Greedy, Sequence, advance, decode
from fucina_course.model import Model
from fucina_course.sampler import Sampler, SamplerConfig
from fucina_course.synth import TINY_QWEN3, cached_synthetic


@pytest.fixture(scope="module")
def tiny():
    return Model.load(cached_synthetic(TINY_QWEN3))


def by_hand(model, prompt, n):
    """Greedy decoding written out: n tokens, each fed back but the last."""
    cache = model.new_cache(len(prompt) + n)
    logits = model.forward_step(prompt, 0, cache)
    out = []
    for i in range(n):
        out.append(int(np.argmax(logits)))
        if i + 1 < n:
            logits = model.forward_step([out[-1]], cache.len, cache)
    return out, cache.len


def test_generate_equals_the_loop_written_out(tiny):
    prompt = tiny.tokenizer.encode("Once upon a time")
    expected, fed = by_hand(tiny, prompt, 12)
    cache = tiny.new_cache(len(prompt) + 12)
    assert tiny.generate(prompt, 12, stop_ids=set(), cache=cache) == expected
    assert cache.len == fed == len(prompt) + 11       # the 12th token was never fed


def test_the_loop_does_not_feed_the_token_at_the_limit_and_a_chat_turn_does(tiny):
    prompt = tiny.tokenizer.encode("Once upon a time")
    seq = Sequence(tiny, tiny.new_cache(64))
    d = Decoder(seq, Greedy, limit=5)
    decode([d], [seq.extend(prompt)])
    expected, _ = by_hand(tiny, prompt, 5)
    assert (d.reason, d.answer, d.ids) == ("max_tokens", expected, expected[:4])
    assert seq.tokens == prompt + expected[:4]
    d.feed_final()
    assert d.ids == d.answer == expected and seq.tokens == prompt + expected
    conv = Conversation(tiny, sampler=SamplerConfig.greedy(), capacity=256,
                        max_response_tokens=5)
    reply = conv.send("Hello")
    assert reply.stop_reason == "max_tokens" and len(reply.ids) == 5
    assert conv.tokens[-5:] == reply.ids and conv.cache.len == len(conv.tokens)
    assert by_hand(tiny, conv.tokens[:-5], 5)[0] == reply.ids
    assert conv.send("Go on").stop_reason == "max_tokens"
    assert conv.cache.len == len(conv.tokens)


def test_an_end_id_ends_the_answer_and_is_not_in_it(tiny):
    prompt = tiny.tokenizer.encode("Once upon a time")
    free, _ = by_hand(tiny, prompt, 10)
    stop = free[6]
    seq = Sequence(tiny, tiny.new_cache(64))
    d = Decoder(seq, Greedy, stop_ids={stop}, limit=50)
    decode([d], [seq.extend(prompt)])
    k = free.index(stop)
    assert (d.reason, d.final, d.ids) == ("end", stop, free[:k]) and d.answer == free[:k]
    assert seq.tokens == prompt + free[:k] and seq.cache.len == len(seq.tokens)


def test_a_full_cache_ends_the_answer(tiny):
    prompt = tiny.tokenizer.encode("Once upon a time")
    seq = Sequence(tiny, tiny.new_cache(len(prompt) + 3))
    d = Decoder(seq, Greedy)
    decode([d], [seq.extend(prompt)])
    free, _ = by_hand(tiny, prompt, 4)
    assert d.reason == "context_full" and d.ids == free[:3] and d.final == free[3]
    assert seq.remaining == 0


def test_on_token_ends_the_answer_when_it_says_so(tiny):
    prompt = tiny.tokenizer.encode("Once upon a time")
    seen = []
    seq = Sequence(tiny, tiny.new_cache(64))
    d = Decoder(seq, Greedy, on_token=lambda t: seen.append(t) or len(seen) == 3)
    decode([d], [seq.extend(prompt)])
    assert d.reason == "stop_string" and d.ids == seen[:2] and d.final == seen[2]


def test_lockstep_decoders_each_equal_their_own_run(tiny):
    prompts = [tiny.tokenizer.encode(t) for t in ("One", "Two and three", "Four")]
    config = SamplerConfig(temperature=0.9, top_k=20, top_p=0.95, min_p=0.0)

    def run(batch):
        seqs = [Sequence(tiny, tiny.new_cache(64)) for _ in batch]
        ds = [Decoder(s, Sampler(config.with_(seed=i)), limit=6 + i)
              for s, i in zip(seqs, batch)]
        decode(ds, [s.extend(prompts[i]) for s, i in zip(seqs, batch)])
        return [d.answer for d in ds]

    together = run([0, 1, 2])
    assert together == [run([i])[0] for i in range(3)]
    assert [len(a) for a in together] == [6, 7, 8]


def test_a_failed_step_commits_nothing(tiny, monkeypatch):
    seq = Sequence(tiny, tiny.new_cache(64))
    d = Decoder(seq, Greedy)
    seq.extend(tiny.tokenizer.encode("Hello"))
    held = seq.tokens
    monkeypatch.setattr(tiny, "forward_step", lambda *a, **k: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        advance([(d, 5)])
    assert seq.tokens == held and d.ids == [] and seq.cache.len == len(held)


@pytest.mark.parametrize("limit", [0, -3])
def test_a_limit_below_one_is_refused(tiny, limit):
    with pytest.raises(FucinaError, match="at least 1"):
        Decoder(Sequence(tiny, tiny.new_cache(8)), Greedy, limit=limit)


def test_generate_refuses_a_cache_that_holds_something(tiny):
    cache = tiny.new_cache(32)
    tiny.forward_step([1, 2, 3], 0, cache)
    with pytest.raises(FucinaError, match="empty cache"):
        tiny.generate([4, 5], 4, cache=cache)


def test_the_logprob_recorder_is_the_log_softmax_of_the_raw_logits(tiny):
    """Each chosen token's record is numpy's log-softmax of the logits `choose`
    saw (not of the biased, tempered ones the sampler drew from), with the k best;
    an end id is not recorded, a Decoder not asked records nothing; `copy_from`
    then gives a second sequence the same cache as a prefill would."""
    prompt = tiny.tokenizer.encode("Once upon a time")
    seq = Sequence(tiny, tiny.new_cache(64))
    sampler = Sampler(SamplerConfig(temperature=1.5, seed=11, logit_bias={7: 5.0}))
    d = Decoder(seq, sampler, limit=6, logprobs=3)
    logits, rows = seq.extend(prompt), []
    while True:
        rows.append(np.asarray(logits, dtype=np.float64))
        tid = d.choose(logits)
        if tid is None:
            break
        logits = advance([(d, tid)])[0]
    assert len(d.logprobs) == len(d.answer) == 6
    for row, entry, tid in zip(rows, d.logprobs, d.answer):
        ref = row - row.max() - np.log(np.exp(row - row.max()).sum())     # [vocab]
        assert entry.id == tid and abs(entry.logprob - ref[tid]) < 1e-9
        best = np.argsort(-ref, kind="stable")[:3]
        assert [i for i, _ in entry.top] == best.tolist()
        np.testing.assert_allclose([lp for _, lp in entry.top], ref[best], atol=1e-9)
    stop = d.answer[2]
    seq2 = Sequence(tiny, tiny.new_cache(64))
    seq2.copy_from(seq, len(prompt) - 1)
    assert seq2.tokens == prompt[:-1] and seq2.cache.len == len(prompt) - 1
    e = Decoder(seq2, Sampler(SamplerConfig(temperature=1.5, seed=11,
                                            logit_bias={7: 5.0})),
                stop_ids={stop}, logprobs=0)
    decode([e], [seq2.extend(prompt[-1:])])
    assert e.reason == "end" and e.ids == d.answer[:2]
    assert [(x.id, x.top) for x in e.logprobs] == [(x.id, []) for x in d.logprobs[:2]]
    np.testing.assert_allclose([x.logprob for x in e.logprobs],
                               [x.logprob for x in d.logprobs[:2]], atol=1e-4)
    assert Decoder(seq, Greedy).logprobs is None


def test_speculation_records_the_same_logprobs(tiny):
    """A verify step's rows are a plain step's: the record is the same, bit for bit."""
    from fucina_course.speculative import PromptLookup, Speculator

    prompt = tiny.tokenizer.encode("a b c a b c a b c a b c a b")

    def run(speculator):
        seq = Sequence(tiny, tiny.new_cache(128))
        d = Decoder(seq, Greedy, limit=30, logprobs=2)
        decode([d], [seq.extend(prompt)], speculator)
        return d

    plain, spec = run(None), run(Speculator(PromptLookup(ngram_max=3, ngram_min=1)))
    assert spec.accepted > 0 and spec.answer == plain.answer
    assert spec.logprobs == plain.logprobs and len(plain.logprobs) == 30
