"""The GGUF reader: same values as the reference `gguf.GGUFReader`, typed getters, clear errors."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from fucina_course import Config, GGUFFile, MetadataError, ModelFileError, UnsupportedArchitecture


def write_gguf(path, arch="qwen3", *, kv=None, tensors=None):
    w = gguf.GGUFWriter(str(path), arch)
    for key, (kind, value) in (kv or {}).items():
        getattr(w, f"add_{kind}")(key, value)
    for name, array in (tensors or {}).items():
        w.add_tensor(name, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


QWEN3_KV = {
    "qwen3.block_count": ("uint32", 2), "qwen3.embedding_length": ("uint32", 64),
    "qwen3.feed_forward_length": ("uint32", 128), "qwen3.attention.head_count": ("uint32", 4),
    "qwen3.attention.head_count_kv": ("uint32", 2), "qwen3.attention.key_length": ("uint32", 32),
    "qwen3.rope.freq_base": ("float32", 1e6), "qwen3.attention.layer_norm_rms_epsilon": ("float32", 1e-6),
    "qwen3.context_length": ("uint32", 4096), "tokenizer.ggml.tokens": ("array", ["a", "b", "c"]),
}


def test_fast_reader_matches_reference_reader(tmp_path):
    strings = ["a", "", "Ġhello", "日本", "x" * 300]
    path = write_gguf(tmp_path / "m.gguf", kv={
        **QWEN3_KV, "tokenizer.ggml.tokens": ("array", strings), "some.ints": ("array", [3, 1, 4, 1, 5]),
        "some.floats": ("array", [0.5, -2.0]), "some.flag": ("bool", True), "some.name": ("string", "héllo"),
    }, tensors={"w": np.arange(12, dtype=np.float32).reshape(3, 4)})
    ours, ref = GGUFFile(path), gguf.GGUFReader(path)
    assert set(ours.fields) == set(ref.fields)
    for key, field in ref.fields.items():
        assert ours.fields[key].contents() == field.contents(), key
    assert ours.get_strings("tokenizer.ggml.tokens") == [s.encode() for s in strings]
    assert ours.get_array("some.ints").tolist() == [3, 1, 4, 1, 5]
    assert ours.get_bool("some.flag") is True and ours.get_str("some.name") == "héllo"
    t = ours.tensor("w")
    assert t.shape == (4, 3) and t.rows == 3 and t.type_name == "F32"
    assert np.array_equal(t.data.view(np.float32), np.arange(12, dtype=np.float32))


def test_typed_getters_name_the_file_and_key(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", kv=QWEN3_KV)
    g = GGUFFile(path)
    assert g.get_int("qwen3.block_count", positive=True) == 2
    with pytest.raises(MetadataError, match=r"m\.gguf.*'qwen3\.nope' is missing"):
        g.get_int("qwen3.nope")
    with pytest.raises(MetadataError, match="should be a string"):
        g.get_str("qwen3.block_count")
    with pytest.raises(MetadataError, match="should be an integer"):
        g.get_int("qwen3.rope.freq_base")
    assert g.get_int("qwen3.nope", 7) == 7


def test_present_but_zero_structural_int_is_an_error(tmp_path):
    path = write_gguf(tmp_path / "zero.gguf", kv={**QWEN3_KV, "qwen3.block_count": ("uint32", 0)})
    with pytest.raises(MetadataError, match="'qwen3.block_count' is 0.*broken file"):
        Config.from_gguf(GGUFFile(path))


def test_config_reads_every_qwen3_key(tmp_path):
    cfg = Config.from_gguf(GGUFFile(write_gguf(tmp_path / "m.gguf", kv=QWEN3_KV)))
    assert (cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads,
            cfg.head_dim) == (2, 64, 128, 4, 2, 32)
    assert cfg.qk_norm and not cfg.qkv_bias and cfg.rope_style == "neox" and cfg.rope_theta == 1e6
    assert cfg.q_dim == 128 and cfg.kv_dim == 64 and cfg.heads_per_kv == 2


def test_config_qwen3moe(tmp_path):
    kv = {k.replace("qwen3.", "qwen3moe."): v for k, v in QWEN3_KV.items()}
    kv["tokenizer.ggml.tokens"] = QWEN3_KV["tokenizer.ggml.tokens"]
    kv.update({"qwen3moe.expert_count": ("uint32", 8), "qwen3moe.expert_used_count": ("uint32", 2),
               "qwen3moe.expert_feed_forward_length": ("uint32", 32)})
    cfg = Config.from_gguf(GGUFFile(write_gguf(tmp_path / "moe.gguf", "qwen3moe", kv=kv)))
    assert (cfg.num_experts, cfg.num_experts_used, cfg.moe_intermediate_size) == (8, 2, 32)
    assert cfg.qk_norm and cfg.norm_topk_prob


def test_qwen3_0_6b_kv_cache_is_112_kib_per_position(qwen3_vocab_path):
    # The vocab-only Qwen3 file carries the 0.6B geometry: 28 layers x K,V x 8 heads x 128 x 2 bytes.
    cfg = Config.from_gguf(GGUFFile(qwen3_vocab_path))
    assert cfg.kv_bytes_per_position("f16") == 114_688 == 28 * 2 * 8 * 128 * 2
    assert cfg.kv_bytes_per_position("q8_0") == 28 * 2 * 8 * 4 * 34


def test_real_models_configs(coder_path, smollm_path):
    coder = Config.from_gguf(GGUFFile(coder_path))
    assert (coder.arch, coder.num_layers, coder.num_heads, coder.num_kv_heads, coder.head_dim) == ("qwen2", 24, 14, 2, 64)
    assert coder.qkv_bias and not coder.qk_norm
    smol = Config.from_gguf(GGUFFile(smollm_path))
    assert (smol.arch, smol.rope_style, smol.vocab_size, smol.num_kv_heads) == ("llama", "normal", 49152, 3)


def test_unsupported_architecture(tmp_path):
    path = write_gguf(tmp_path / "gemma.gguf", "gemma3")
    with pytest.raises(UnsupportedArchitecture, match="'gemma3'"):
        Config.from_gguf(GGUFFile(path))


def test_file_errors(tmp_path, smollm_path):
    with pytest.raises(ModelFileError, match="no such file"):
        GGUFFile(tmp_path / "missing.gguf")
    with pytest.raises(ModelFileError, match="is a directory"):
        GGUFFile(tmp_path)
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    with pytest.raises(ModelFileError, match="not a GGUF file"):
        GGUFFile(text)
    head = smollm_path.read_bytes()[:5_000_000]
    for cut, what in [(100, "metadata runs past"), (len(head), "tensor 'token_embd.weight' ends at byte")]:
        short = tmp_path / f"short{cut}.gguf"
        short.write_bytes(head[:cut])
        with pytest.raises(ModelFileError, match=f"truncated GGUF file.*{what}"):
            GGUFFile(short)
