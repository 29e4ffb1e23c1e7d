"""The `fucina` command: real output on good input, one clear line and a non-zero exit on bad input."""

from __future__ import annotations

import subprocess
import sys

import gguf
import numpy as np
import pytest


def run(*args, stdin=None):
    return subprocess.run([sys.executable, "-m", "fucina_course", *map(str, args)], input=stdin,
                          capture_output=True, timeout=600)


def test_info_prints_config_tokenizer_formats_and_kv(coder_path):
    r = run("info", coder_path)
    out = r.stdout.decode()
    assert r.returncode == 0, r.stderr
    for needle in ["architecture: qwen2", "num_layers: 24", "pre='qwen2'", "151,936 tokens", "Q5_0:",
                   "Q6_K:", "kv cache per position: 12,288 bytes f16"]:
        assert needle in out, needle


def test_tokenize_prints_one_id_per_line(qwen3_vocab_path, tmp_path):
    from conftest import tokenizer_for

    text = "What is the capital of France?\n<|im_end|> 12 😀"
    f = tmp_path / "in.txt"
    f.write_text(text, encoding="utf-8")
    r = run("tokenize", qwen3_vocab_path, f)
    assert r.returncode == 0, r.stderr
    assert [int(x) for x in r.stdout.split()] == tokenizer_for(qwen3_vocab_path).encode(text)
    r2 = run("tokenize", qwen3_vocab_path, "-", stdin=text.encode())
    assert r2.stdout == r.stdout


def _no_tokenizer_gguf(path):
    w = gguf.GGUFWriter(str(path), "qwen3")
    w.add_block_count(1)
    w.add_tensor("x", np.zeros(4, np.float32))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    return path


@pytest.mark.parametrize("case", ["missing", "directory", "not_gguf", "truncated", "no_tokenizer", "bad_name"])
def test_bad_input_gives_one_line_and_nonzero_exit(case, tmp_path, smollm_path):
    text_file = tmp_path / "t.txt"
    text_file.write_text("hello")
    model = {
        "missing": tmp_path / "nope.gguf",
        "directory": tmp_path,
        "not_gguf": text_file,
        "truncated": tmp_path / "short.gguf",
        "no_tokenizer": _no_tokenizer_gguf(tmp_path / "notok.gguf"),
        "bad_name": "no-such-model",
    }[case]
    if case == "truncated":
        model.write_bytes(smollm_path.read_bytes()[:3_000_000])
    expected = {"missing": "no such file", "directory": "is a directory", "not_gguf": "not a GGUF file",
                "truncated": "truncated GGUF file", "no_tokenizer": "has no tokenizer",
                "bad_name": "neither a file nor a known model name"}[case]
    r = run("tokenize", model, text_file)
    err = r.stderr.decode()
    assert r.returncode == 1
    assert err.count("\n") == 1 and err.startswith("fucina: error:") and expected in err, err
    assert "Traceback" not in err and r.stdout == b""


def test_tokenize_missing_input_file(qwen3_vocab_path, tmp_path):
    r = run("tokenize", qwen3_vocab_path, tmp_path / "absent.txt")
    assert r.returncode == 1 and b"no such file" in r.stderr


def test_models_list():
    r = run("models", "list")
    assert r.returncode == 0 and b"qwen2.5-coder-0.5b (default)" in r.stdout


def test_chat_answers_the_france_question(coder_path):
    r = run("generate", "qwen2.5-coder-0.5b", "--chat", "--prompt", "What is the capital of France?", "--gen", "16")
    assert r.returncode == 0, r.stderr
    assert r.stdout.decode().strip() == "The capital of France is Paris."


def test_logits_compare_and_verify_cache(tmp_path):
    from fucina_course.synth import TINY_QWEN3, write_synthetic

    model = write_synthetic(TINY_QWEN3, tmp_path / "tiny.gguf")
    out = tmp_path / "l.npy"
    assert run("logits", model, "--ids", "1,2,3", "--all", "--out", out).returncode == 0
    assert np.load(out).shape == (3, TINY_QWEN3.vocab_size)
    same = run("logits", model, "--ids", "1,2,3", "--all", "--compare", out)
    assert same.returncode == 0 and b"argmax identical at every position: True" in same.stdout
    other = run("logits", model, "--ids", "1,2,4", "--all", "--compare", out)
    assert other.returncode == 1 and b"fucina: error:" in other.stderr
    vc = run("verify-cache", model, "--ids", "5,6,7", "--steps", "4")
    assert vc.returncode == 0 and b"like for like: worst 0, argmax equal at 5/5" in vc.stdout
    bench = run("bench", model, "--pp", "4", "--tg", "4", "--repeats", "1", "--json")
    import json
    result = json.loads(bench.stdout)
    assert result["prefill"][0]["tokens"] == 4 and result["decode"]["tok_s"] > 0


@pytest.mark.parametrize("case", ["unsupported_format", "shape_mismatch", "context_overflow"])
def test_engine_errors_are_one_line(case, tmp_path):
    from fucina_course.synth import TINY_QWEN3, write_synthetic

    kwargs, args, expected = {
        "unsupported_format": ({"type_overrides": {"blk.0.attn_v.weight": "IQ4_NL"}}, ["--ids", "1,2"],
                               "'blk.0.attn_v.weight' is stored as IQ4_NL"),
        "shape_mismatch": ({"metadata_overrides": {"qwen3.attention.head_count": 8}}, ["--ids", "1,2"],
                           "'blk.0.attn_q.weight' has shape"),
        "context_overflow": ({"metadata_overrides": {"qwen3.context_length": 8}}, ["--ids", ",".join(["1"] * 9)],
                             "9 tokens do not fit in the model's context of 8"),
    }[case]
    model = write_synthetic(TINY_QWEN3, tmp_path / f"{case}.gguf", **kwargs)
    r = run("logits", model, *args)
    err = r.stderr.decode()
    assert r.returncode == 1 and err.count("\n") == 1 and expected in err, err
    assert "Traceback" not in err
