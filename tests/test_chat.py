"""Chat: templates (hostile ones included), the Conversation loop on the default
model, streaming, and the `fucina chat` command's answers and errors."""

from __future__ import annotations

import subprocess
import sys
import time

import numpy as np
import pytest

from fucina_course.chat import EMPTY_THINK, ChatFormat, Conversation
from fucina_course.text_stream import without_think
from fucina_course.chat_template import CHATML, ChatTemplate
from fucina_course.errors import ContextFull, FucinaError
from fucina_course.sampler import Sampler, SamplerConfig

QUESTION = "What is the capital of France?"

# A Qwen3-style template written for these tests: past assistant turns lose their
# think block, and `enable_thinking=false` pre-fills an empty one.
QWEN3_STYLE = (
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and not loop.last %}"
    "{{- '<|im_start|>assistant\\n' + m.content.split('</think>')[-1].lstrip('\\n')"
    " + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"
)


def run_cli(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "fucina_course", *map(str, args)],
                          capture_output=True, timeout=timeout)


@pytest.fixture(scope="module")
def model(coder_model):
    return coder_model


@pytest.fixture(scope="module")
def qwen3_tok():
    from fucina_course.catalog import qwen3_tokenizer

    return qwen3_tokenizer()


def greedy_conversation(model, **kw):
    return Conversation(model, sampler=SamplerConfig.greedy(), capacity=512, **kw)


def forcing(tokens, end):
    """A logit processor that makes the model say `tokens`, then `end`."""
    calls = [0]

    def processor(logits, history):
        i = calls[0]
        calls[0] += 1
        forced = np.full_like(logits, -np.inf)
        forced[tokens[i] if i < len(tokens) else end] = 0.0
        return forced
    return processor


# --- templates -----------------------------------------------------------------------

M = [{"role": "user", "content": "hi"}]

HOSTILE = {  # the kinds issue 11 found escaping, and their cousins
    "division by zero": "{{ 1/0 }}",
    "self-calling macro": "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}",
    "huge range": "{% for i in range(10**9) %}{% endfor %}",
    "huge string": "{{ 'x' * 10**10 }}",
    "huge integer printed": "{{ 10 ** 5000 }}",
    "huge power": "{{ 2 ** (10**9) }}",
    "include": "{% include 'other.jinja' %}",
    "extends": "{% extends 'base.jinja' %}",
    "nested loops": "{% for a in range(100000) %}{% for b in range(100000) %}"
                    "{% endfor %}{% endfor %}",
    "string doubled in a loop": "{% set ns = namespace(s='x') %}"
                                "{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}"
                                "{% endfor %}{{ ns.s }}",
    "list doubled in a loop": "{% set ns = namespace(s=[1]) %}{% for i in range(64) %}"
                              "{% set ns.s = ns.s + ns.s %}{% endfor %}",
    "wide center filter": "{{ 'x' | center(10**10) }}",
    "wide center method": "{{ 'x'.center(10**10) }}",
    "star width": "{{ '%*d' % (10**9, 1) }}",
    "format width": "{{ '{:>999999999}'.format(1) }}",
    "replace blow-up": "{{ ('x' * 1000000) | replace('x', 'xxxxxxxxxx') }}",
    "nested list printed": "{% set a = ['x' * 100000] * 10 %}{% set b = [a] * 10 %}"
                           "{% set c = [b] * 10 %}{{ c }}",
    "big output": "{% for a in range(100000) %}{{ 'y' * 1000 }}{% endfor %}",
    "raise_exception": "{{ raise_exception('only user and assistant roles') }}",
    "syntax error": "{% for %}",
    "python internals": "{{ ''.__class__.__mro__ }}",
    "undefined": "{{ foo.bar.baz }}",
}


@pytest.mark.parametrize("kind", list(HOSTILE))
def test_hostile_template_is_one_fucina_error_in_bounded_time(kind):
    t0 = time.perf_counter()
    with pytest.raises(FucinaError) as e:
        ChatTemplate(HOSTILE[kind], name="'evil.gguf'", time_budget=0.5).render(M)
    elapsed = time.perf_counter() - t0
    message = str(e.value)
    assert message.startswith("chat template 'evil.gguf'") and "\n" not in message
    assert elapsed < 5.0, elapsed   # 0.5 s budget, plus a loaded 2-core machine


def test_hostile_template_in_a_model_file_fails_the_turn_not_the_process(model):
    conv = greedy_conversation(model, template=HOSTILE["self-calling macro"])
    with pytest.raises(FucinaError, match="chat template .*recursion"):
        conv.send(QUESTION)
    assert conv.tokens == [] and conv.cache.len == 0


def test_bounds_do_not_touch_a_real_template(model):
    fmt = ChatFormat(model.tokenizer)
    long = [{"role": "user" if i % 2 == 0 else "assistant", "content": "word " * 500}
            for i in range(199)]
    text = fmt.render(long)
    plain = fmt.template._template.render(messages=long, add_generation_prompt=True)
    assert text == plain and text.count("<|im_start|>") == 201  # + default system


def test_chatml_is_one_constant_and_renders_as_expected(qwen3_tok):
    from fucina_course import qwen_vocab

    assert qwen_vocab.CHATML_TEMPLATE is CHATML
    assert qwen3_tok.chat_template == CHATML
    text = ChatFormat(qwen3_tok).render([{"role": "system", "content": "Be brief."},
                                         {"role": "user", "content": "Hi"}])
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n"
                    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    ids = qwen3_tok.encode_raw(text)
    assert ids.count(qwen3_tok.token_id("<|im_start|>")) == 3  # markers: single ids


def test_no_think(model, qwen3_tok):
    # A thinking vocabulary whose template ignores enable_thinking: pre-filled.
    fmt = ChatFormat(qwen3_tok)
    assert fmt.can_think
    assert fmt.render(M, no_think=True) == fmt.render(M) + EMPTY_THINK
    # A template that reads enable_thinking does it itself (and only once).
    fmt3 = ChatFormat(qwen3_tok, template=QWEN3_STYLE)
    text = fmt3.render(M, no_think=True)
    assert text.endswith("<|im_start|>assistant\n" + EMPTY_THINK)
    assert text.count("<think>") == 1
    # A model without think tokens never thinks: nothing changes.
    coder = ChatFormat(model.tokenizer)
    assert not coder.can_think and coder.render(M, no_think=True) == coder.render(M)


def test_stop_ids_are_the_end_markers(model):
    fmt = ChatFormat(model.tokenizer)
    tok = model.tokenizer
    assert fmt.end_marker == "<|im_end|>"
    assert {tok.token_id("<|im_end|>"), tok.token_id("<|endoftext|>")} <= fmt.stop_ids


def test_without_think():
    assert without_think("<think>\nhm\n</think>\n\nParis") == "Paris"
    assert without_think("<think>still going") == ""
    assert without_think("no block") == "no block"


# --- the conversation on the default model ----------------------------------------

def test_paris_then_a_second_turn_from_the_cache(model):
    tok = model.tokenizer
    conv = greedy_conversation(model)
    first = conv.send(QUESTION)
    assert "Paris" in first.text and first.stop_reason == "end"
    prompt1 = tok.encode_raw(conv.format.render(conv.messages[:1]))
    assert (first.prefilled, first.reused) == (len(prompt1), 0)
    in_cache = len(prompt1) + len(first.ids)
    assert conv.cache.len == len(conv.tokens) == in_cache

    second = conv.send("And of Italy?")
    assert "Rome" in second.text
    full = tok.encode_raw(conv.format.render(conv.messages[:-1]))
    # Only the new turn was prefilled: the end marker of the first answer, the
    # user turn and the assistant header -- never the history.
    assert second.reused == in_cache
    assert second.prefilled == len(full) - in_cache
    assert second.prefilled < 20
    assert conv.tokens == full + second.ids


def test_greedy_equals_model_generate(model):
    conv = greedy_conversation(model)
    reply = conv.send(QUESTION)
    prompt = model.tokenizer.encode_raw(conv.format.render(conv.messages[:1]))
    out = model.generate(prompt, 64, stop_ids=conv.format.stop_ids)
    assert out[-1] in conv.format.stop_ids and out[:-1] == reply.ids


def test_same_seed_same_text_different_seed_different_text(model):
    def answer(seed):
        conv = Conversation(model, capacity=128, max_response_tokens=12,
                            sampler=SamplerConfig(temperature=1.0, top_k=0, top_p=1.0,
                                                  min_p=0.0, seed=seed))
        return conv.send("Write a short poem about the sea.").text

    a = answer(1)
    assert answer(1) == a
    assert answer(2) != a


def test_streaming_splits_no_character(model):
    tok = model.tokenizer
    target = "Ciao! 😀 naïve café 日本 ❤️ 🇮🇹"
    ids = tok.encode_raw(target)
    split = [t for t in ids if _not_utf8(tok.token_to_bytes(t))]
    assert split, "the test text must put a character across tokens"
    end = tok.token_id("<|im_end|>")
    conv = Conversation(model, capacity=256,
                        sampler=Sampler(SamplerConfig.greedy(),
                                        logit_processor=forcing(ids, end)))
    pieces = []
    reply = conv.send("Say something.", stream=pieces.append)
    streamed = "".join(pieces)
    assert reply.ids == ids and reply.stop_reason == "end"
    assert "\ufffd" not in streamed and all("\ufffd" not in p for p in pieces)
    assert streamed == tok.decode(reply.ids) == target == reply.text


def _not_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return True
    return False


def test_stream_to_a_file_like_writer(model, tmp_path):
    conv = greedy_conversation(model)
    with open(tmp_path / "out.txt", "w", encoding="utf-8") as f:
        reply = conv.send(QUESTION, stream=f)
    assert (tmp_path / "out.txt").read_text(encoding="utf-8") == reply.text


def test_stop_string_is_never_shown(model):
    conv = greedy_conversation(model, stop=["Paris"])
    pieces = []
    reply = conv.send(QUESTION, stream=pieces.append)
    assert reply.stop_reason == "stop_string"
    assert "".join(pieces) == reply.text == "The capital of France is "
    assert conv.cache.len == len(conv.tokens)
    assert "Rome" in conv.send("And of Italy?").text   # still a working conversation


def test_context_full_leaves_the_conversation_usable(model):
    conv = Conversation(model, sampler=SamplerConfig.greedy(), capacity=96)
    with pytest.raises(ContextFull, match="positions"):
        conv.send("word " * 200)
    assert conv.tokens == [] and conv.messages == [] and conv.cache.len == 0
    reply = conv.send(QUESTION)
    assert "Paris" in reply.text
    with pytest.raises(ContextFull):
        conv.send("word " * 60)
    assert len(conv.messages) == 2 and conv.cache.len == len(conv.tokens)


def test_empty_message_is_refused(model):
    with pytest.raises(FucinaError, match="empty"):
        greedy_conversation(model).send("  \n")


def test_max_response_tokens(model):
    reply = Conversation(model, sampler=SamplerConfig.greedy(), capacity=256,
                         max_response_tokens=3).send(QUESTION)
    assert len(reply.ids) == 3 and reply.stop_reason == "max_tokens"


def test_send_rendered_reuses_the_longest_common_prefix(model):
    tok = model.tokenizer
    conv = greedy_conversation(model)
    conv.send(QUESTION)
    history = conv.messages + [{"role": "user", "content": "And of Italy?"}]
    in_cache = conv.cache.len
    reply = conv.send_rendered(history)
    full = tok.encode_raw(conv.format.render(history))
    assert (reply.reused, reply.prefilled) == (in_cache, len(full) - in_cache)
    assert "Rome" in reply.text
    # An edited earlier turn: rewind to where the ids first differ.
    edited = [{"role": "user", "content": "What is the capital of Spain?"}]
    n_same = len(tok.encode_raw(conv.format.render(edited)))  # upper bound
    reply = conv.send_rendered(edited)
    assert "Madrid" in reply.text and 0 < reply.reused < n_same
    assert conv.tokens[:reply.reused + reply.prefilled] == \
        tok.encode_raw(conv.format.render(edited))


def test_a_template_that_rewrites_history_falls_back_to_prefix_reuse(model):
    tok = model.tokenizer
    answer = tok.encode_raw("<think>\nhm\n</think>\n\nParis.")
    end = tok.token_id("<|im_end|>")
    conv = Conversation(model, capacity=256, template=QWEN3_STYLE,
                        sampler=Sampler(SamplerConfig.greedy(),
                                        logit_processor=forcing(answer, end)))
    conv.send(QUESTION)
    cached = conv.cache.len
    conv.sampler.logit_processor = None
    reply = conv.send("And of Italy?")
    # The template dropped the think block from the first answer: the ids differ
    # from there on, so the cache was rewound to the common prefix.
    assert reply.reused < cached
    expected = tok.encode_raw(conv.format.render(conv.messages[:-1]))
    assert conv.tokens == expected + reply.ids


def test_send_batch_equals_one_at_a_time(model):
    questions = [QUESTION, "What is the capital of Germany?"]
    alone = [greedy_conversation(model).send(q).text for q in questions]
    convs = [greedy_conversation(model) for _ in questions]
    streams = [[], []]
    replies = Conversation.send_batch(convs, questions,
                                      streams=[s.append for s in streams])
    assert [r.text for r in replies] == alone
    assert ["".join(s) for s in streams] == alone
    for c in convs:
        assert c.cache.len == len(c.tokens)
    second = Conversation.send_batch(convs, ["And of Italy?", "And of Spain?"])
    assert "Rome" in second[0].text and "Madrid" in second[1].text
    assert all(r.prefilled < 20 for r in second)


def test_interrupted_answer_keeps_a_consistent_conversation(model):
    conv = greedy_conversation(model)
    seen = []

    def stream(text):
        seen.append(text)
        if len(seen) == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        conv.send("Count from 1 to 50, separated by commas.", stream=stream)
    assert conv.cache.len == len(conv.tokens)
    assert conv.messages[-1]["role"] == "assistant"
    assert "Paris" in conv.send(QUESTION).text


def test_a_failed_step_leaves_ids_and_cache_aligned(model, monkeypatch):
    """A forward step that fails (here: its logits come out non-finite, the last
    check of a step) changes neither the cache nor the conversation's ids: a
    decode step, a prefill and a batch step each raise and leave them aligned, and
    the conversation then answers as a fresh one does (the server reuses a slot's
    conversation for the next request in the same way)."""
    from fucina_course import NonFiniteValues

    conv, other = greedy_conversation(model), greedy_conversation(model)
    conv.send(QUESTION)
    other.send("Hello")
    held = conv.tokens
    monkeypatch.setattr(model, "output_norm", np.full_like(model.output_norm, np.inf))
    for step in (lambda: Conversation.step([conv], [held[-1]]),
                 lambda: conv.extend(held[-3:]),
                 lambda: Conversation.step([conv, other], [11, 12])):
        with pytest.raises(NonFiniteValues):
            step()
        assert conv.tokens == held and conv.cache.len == len(held)
        assert other.cache.len == len(other.tokens)
    monkeypatch.undo()
    again = conv.send("And of Italy?")
    fresh = greedy_conversation(model)
    fresh.send(QUESTION)
    assert again.text == fresh.send("And of Italy?").text


# --- the command --------------------------------------------------------------------

def test_cli_chat_answers_paris():
    r = run_cli("chat", "qwen2.5-coder-0.5b", QUESTION, "--temp", "0")
    assert r.returncode == 0, r.stderr
    assert b"Paris" in r.stdout


@pytest.mark.parametrize("args, expected", [
    (["chat", "qwen2.5-coder-0.5b", ""], "the question is empty"),
    (["chat", "  "], "the question is empty"),
    (["chat", "hi", "--top-p", "0"], "top_p"),
    (["chat", "hi", "--top-p", "1.5"], "top_p"),
    (["chat", "hi", "--top-k", "-1"], "top_k"),
    (["chat", "hi", "--temp", "nan"], "temperature"),
    (["chat", "qwen2.5-coder-0.5b", "word " * 200, "--ctx", "64"], "positions"),
    (["chat", "a", "b", "c"], "one quoted argument"),
    (["repl", "--min-p", "2"], "min_p"),
])
def test_cli_bad_input_is_one_line_and_exit_1(args, expected):
    r = run_cli(*args)
    err = r.stderr.decode()
    assert r.returncode == 1, err
    assert err.count("\n") == 1 and err.startswith("fucina: error:"), err
    assert expected in err and "Traceback" not in err


def test_held_back_waits_only_for_what_may_begin_a_needle():
    from fucina_course.text_stream import held_back
    assert held_back("abc<thi", 7, ["<think>"]) == 4
    assert held_back("abc<think>", 10, ["<think>"]) == 0     # a whole needle is found, not held
    assert held_back("ok\nUs", 5, ["\nUser:", "Us"]) == 3      # the longest of the needles
    assert held_back("abcdef", 3, ["cde"]) == 1               # only text[:end] counts
    assert held_back("plain", 5, []) == 0
