"""validate.py, one check at a time: what a model needs from a parsed GGUF file.

Broken files are made from a valid tiny synthetic model with the fuzzer's serializer
(tests/gguf_fuzz.py); every valid file the suite knows (both real models, every
synthetic format) must pass all the checks.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

import gguf_fuzz as fuzz
from fucina_course import Config, GGUFFile, Tokenizer, validate
from fucina_course.errors import (MetadataError, NonFiniteValues, ShapeMismatch,
                                  TokenizerError, UnsupportedFormat)


@pytest.fixture(scope="module")
def base_path():
    return fuzz.base_paths()[0]  # tiny Qwen3, Q8_0


@pytest.fixture(scope="module")
def base_doc(base_path):
    return fuzz.parse(base_path)


def load(tmp_path, doc):
    path = tmp_path / "m.gguf"
    path.write_bytes(fuzz.serialize(doc)[0])
    g = GGUFFile(path)
    return g, Config.from_gguf(g)


def test_every_valid_file_passes(coder_path, smollm_path):
    for path in [coder_path, smollm_path, *fuzz.base_paths()]:
        g = GGUFFile(path)
        validate.check_model_file(g, Config.from_gguf(g), Tokenizer.from_gguf(g))


def test_known_keys_must_hold_their_kind_of_value(tmp_path, base_doc):
    for key, vtype, value in [("qwen3.attention.value_length", fuzz.F32, 64.0),
                              ("tokenizer.ggml.add_bos_token", fuzz.U8, 0),
                              ("general.name", fuzz.U32, 7)]:
        doc = base_doc.copy()
        kv = doc.kv(key)
        kv.vtype, kv.value = vtype, value
        g, _ = load(tmp_path, doc)
        with pytest.raises(MetadataError, match=f"'{key}' should be"):
            validate.check_metadata(g)


@pytest.mark.parametrize("change, match", [
    (dict(num_layers=2000), "'qwen3.block_count' is 2,000; it must be in 1..1,024"),
    (dict(num_kv_heads=3), "'qwen3.attention.head_count_kv' is 3; it must divide"),
    (dict(num_kv_heads=8), "'qwen3.attention.head_count_kv' is 8; it must be in 1..4"),
    (dict(head_dim=63), "RoPE rotates channel pairs"),
    (dict(context_length=2**32 - 1), "'qwen3.context_length' is 4,294,967,295"),
    (dict(rms_norm_eps=math.nan), "layer_norm_rms_epsilon' is nan"),
    (dict(rms_norm_eps=0.0), "it must be in \\(0, 1\\)"),
    (dict(rope_theta=math.inf), "'qwen3.rope.freq_base' is inf"),
    (dict(rope_theta=-1.0), "it must be a positive number"),
    (dict(vocab_size=2**22), "'qwen3.vocab_size' is 4,194,304"),
    (dict(intermediate_size=2**20), "'qwen3.feed_forward_length' is 1,048,576"),
])
def test_config_values_in_sane_ranges(tmp_path, base_doc, change, match):
    g, cfg = load(tmp_path, base_doc)
    validate.check_config(cfg, g)
    with pytest.raises(MetadataError, match=match):
        validate.check_config(replace(cfg, **change), g)


def test_config_keys_that_must_agree_with_the_head_size(tmp_path, base_doc):
    for key, value in [("qwen3.attention.value_length", 32),
                       ("qwen3.rope.dimension_count", 32)]:
        doc = base_doc.copy()
        doc.kvs = [kv for kv in doc.kvs if kv.key != key.encode()]
        doc.kvs.append(fuzz.KV(key.encode(), fuzz.U32, value))
        g, cfg = load(tmp_path, doc)
        match = f"'{key}' is 32; .* head size \\(64\\)"
        with pytest.raises(MetadataError, match=match):
            validate.check_config(cfg, g)
    doc = base_doc.copy()
    doc.kvs = [kv for kv in doc.kvs if kv.key != b"qwen3.attention.key_length"]
    doc.kv("qwen3.embedding_length").value = 250  # not a multiple of the 4 heads
    g, cfg = load(tmp_path, doc)
    with pytest.raises(MetadataError, match="multiple of the 4 heads"):
        validate.check_config(cfg, g)


def test_expected_tensors_follow_the_family(tmp_path, base_doc):
    g, cfg = load(tmp_path, base_doc)
    names = validate.expected_tensors(cfg)
    assert set(names) == set(g.tensors)  # tied embeddings: no output.weight
    assert names["blk.1.attn_k.weight"] == ((256, 128), "matrix")
    assert names["blk.0.attn_q_norm.weight"] == ((64,), "vector")
    qwen2 = validate.expected_tensors(replace(cfg, family=validate_family("qwen2")))
    assert "blk.0.attn_q.bias" in qwen2 and "blk.0.attn_q_norm.weight" not in qwen2


def validate_family(arch):
    from fucina_course.families import FAMILIES

    return FAMILIES[arch]


def _tensor_case(doc, tensor, **change):
    t = doc.tensor(tensor)
    for k, v in change.items():
        setattr(t, k, v)
    return doc


@pytest.mark.parametrize("edit, error, match", [
    (lambda d: _tensor_case(d, "blk.0.attn_norm.weight", dims=[256, 1]), ShapeMismatch,
     "'blk.0.attn_norm.weight' has shape \\[256, 1\\] but the config implies "
     "\\[256\\]"),
    (lambda d: _tensor_case(d, "blk.1.attn_k.weight", name=b"blk.1.attn_kk.weight"),
     MetadataError, "tensor 'blk.1.attn_k.weight' is missing"),
    (lambda d: _tensor_case(d, "blk.1.ffn_down.weight", name=b"rope_freqs.weight"),
     MetadataError, "tensor 'blk.1.ffn_down.weight' is missing"),
])
def test_tensors_present_with_the_exact_shape(tmp_path, base_doc, edit, error, match):
    g, cfg = load(tmp_path, edit(base_doc.copy()))
    with pytest.raises(error, match=match):
        validate.check_tensors(g, cfg)


def test_leftover_tensors_and_types(tmp_path, base_doc):
    doc = base_doc.copy()
    doc.kv("qwen3.block_count").value = 1  # blk.1.* are now left over
    g, cfg = load(tmp_path, doc)
    match = "'blk.1.attn_norm.weight' \\(and 10 more\\) is not part of a qwen3 model"
    with pytest.raises(MetadataError, match=match):
        validate.check_tensors(g, cfg)
    doc = base_doc.copy()
    t = doc.tensor("blk.0.ffn_norm.weight")  # F32 [256] -> F16 [512]: same bytes
    t.ttype, t.dims = 1, [512]
    g, cfg = load(tmp_path, doc)
    match = "'blk.0.ffn_norm.weight' has shape \\[512\\]"
    with pytest.raises(ShapeMismatch, match=match):
        validate.check_tensors(g, cfg)


def test_vector_type_and_finiteness(tmp_path, base_doc, monkeypatch):
    g, cfg = load(tmp_path, base_doc)
    real = g.tensors["blk.0.attn_norm.weight"]
    monkeypatch.setitem(g.tensors, "blk.0.attn_norm.weight",
                        replace(real, ggml_type=type(real.ggml_type)(1)))
    with pytest.raises(UnsupportedFormat, match="is F16; norm weights and biases must "
                                                "be F32"):
        validate.check_tensors(g, cfg)
    values = np.ones(256, np.float32)
    values[7] = np.nan
    monkeypatch.setitem(g.tensors, "blk.0.attn_norm.weight",
                        replace(real, data=values.view(np.uint8)))
    with pytest.raises(NonFiniteValues, match="'blk.0.attn_norm.weight' contains 1 "
                                              "NaN/inf value of 256 \\(first at flat "
                                              "index 7\\)"):
        validate.check_tensors(g, cfg)


def test_matrix_types_the_engine_computes_with(tmp_path, base_doc):
    doc = base_doc.copy()
    last = doc.tensors[-1]  # relabel the last matrix to Q2_K: a type with no kernel
    assert last.name == b"blk.1.ffn_down.weight" and last.dims == [512, 256]
    last.ttype = 10
    n = fuzz.tensor_nbytes(last.dims, 10)
    doc.data = doc.data[:last.offset + n]
    g, cfg = load(tmp_path, doc)
    match = "'blk.1.ffn_down.weight' is stored as Q2_K"
    with pytest.raises(UnsupportedFormat, match=match):
        validate.check_tensors(g, cfg)


def test_vocabulary_matches_the_embedding(tmp_path, base_doc, base_path):
    g = GGUFFile(base_path)
    cfg, tok = Config.from_gguf(g), Tokenizer.from_gguf(g)
    validate.check_vocabulary(cfg, tok)
    validate.check_vocabulary(cfg, None)  # no tokenizer: nothing to compare
    with pytest.raises(TokenizerError, match="4,096 tokens but the model has 4,097 "
                                             "embedding rows"):
        validate.check_vocabulary(replace(cfg, vocab_size=4097), tok, "m.gguf")


def test_check_finite_and_logits():
    x = np.zeros((3, 4), np.float32)
    assert validate.check_finite(x, "x") is x
    x[1, 2], x[2, 0] = np.inf, np.nan
    match = "layer 3 \\(ffn\\) contains 2 NaN/inf values of 12 \\(first at flat index 6"
    with pytest.raises(NonFiniteValues, match=match):
        validate.check_finite(x, "layer 3 (ffn)")
    match = "m.gguf: the logits contain.*check_numerics=True names the first layer"
    with pytest.raises(NonFiniteValues, match=match):
        validate.check_logits(np.array([0.0, np.nan], np.float32), "m.gguf")
