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
