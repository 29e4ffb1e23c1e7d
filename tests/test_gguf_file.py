"""The GGUF reader: the reference reader's values, typed getters, hostile input refused.

Each container rule of gguf_file.py has a test below that builds a file breaking it
(with the fuzzer's serializer, tests/gguf_fuzz.py) and checks the one-line error.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from fucina_course import (Config, GGUFFile, MetadataError, ModelFileError,
                           UnsupportedArchitecture)
from gguf_fuzz import ARR, F32, I32, KV, STR, U32, U64, Doc, TInfo, serialize


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
    "qwen3.feed_forward_length": ("uint32", 128),
    "qwen3.attention.head_count": ("uint32", 4),
    "qwen3.attention.head_count_kv": ("uint32", 2),
    "qwen3.attention.key_length": ("uint32", 32),
    "qwen3.rope.freq_base": ("float32", 1e6),
    "qwen3.attention.layer_norm_rms_epsilon": ("float32", 1e-6),
    "qwen3.context_length": ("uint32", 4096),
    "tokenizer.ggml.tokens": ("array", ["a", "b", "c"]),
}


def test_fast_reader_matches_reference_reader(tmp_path):
    strings = ["a", "", "Ġhello", "日本", "x" * 300]
    path = write_gguf(tmp_path / "m.gguf", kv={
        **QWEN3_KV, "tokenizer.ggml.tokens": ("array", strings),
        "some.ints": ("array", [3, 1, 4, 1, 5]), "some.floats": ("array", [0.5, -2.0]),
        "some.flag": ("bool", True), "some.name": ("string", "héllo"),
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
    path = write_gguf(tmp_path / "zero.gguf",
                      kv={**QWEN3_KV, "qwen3.block_count": ("uint32", 0)})
    with pytest.raises(MetadataError, match="'qwen3.block_count' is 0.*broken file"):
        Config.from_gguf(GGUFFile(path))


def test_config_reads_every_qwen3_key(tmp_path):
    cfg = Config.from_gguf(GGUFFile(write_gguf(tmp_path / "m.gguf", kv=QWEN3_KV)))
    assert (cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.num_heads,
            cfg.num_kv_heads, cfg.head_dim) == (2, 64, 128, 4, 2, 32)
    assert cfg.qk_norm and not cfg.qkv_bias
    assert cfg.rope_style == "neox" and cfg.rope_theta == 1e6
    assert cfg.q_dim == 128 and cfg.kv_dim == 64 and cfg.heads_per_kv == 2


def test_config_qwen3moe(tmp_path):
    kv = {k.replace("qwen3.", "qwen3moe."): v for k, v in QWEN3_KV.items()}
    kv["tokenizer.ggml.tokens"] = QWEN3_KV["tokenizer.ggml.tokens"]
    kv.update({"qwen3moe.expert_count": ("uint32", 8),
               "qwen3moe.expert_used_count": ("uint32", 2),
               "qwen3moe.expert_feed_forward_length": ("uint32", 32)})
    path = write_gguf(tmp_path / "moe.gguf", "qwen3moe", kv=kv)
    cfg = Config.from_gguf(GGUFFile(path))
    assert (cfg.num_experts, cfg.num_experts_used,
            cfg.moe_intermediate_size) == (8, 2, 32)
    assert cfg.qk_norm and cfg.norm_topk_prob


def test_qwen3_0_6b_kv_cache_is_112_kib_per_position(qwen3_vocab_path):
    # The vocab-only Qwen3 file carries the 0.6B geometry: 28 layers x K,V x 8 heads x
    # 128 x 2 bytes.
    cfg = Config.from_gguf(GGUFFile(qwen3_vocab_path))
    assert cfg.kv_bytes_per_position("f16") == 114_688 == 28 * 2 * 8 * 128 * 2
    assert cfg.kv_bytes_per_position("q8_0") == 28 * 2 * 8 * 4 * 34


def test_real_models_configs(coder_path, smollm_path):
    coder = Config.from_gguf(GGUFFile(coder_path))
    assert (coder.arch, coder.num_layers, coder.num_heads, coder.num_kv_heads,
            coder.head_dim) == ("qwen2", 24, 14, 2, 64)
    assert coder.qkv_bias and not coder.qk_norm
    smol = Config.from_gguf(GGUFFile(smollm_path))
    assert (smol.arch, smol.rope_style, smol.vocab_size,
            smol.num_kv_heads) == ("llama", "normal", 49152, 3)


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
    for cut, what in [(100, "claims 33 metadata keys but only 76 bytes follow"),
                      (len(head), "tensor 'token_embd.weight' ends at byte")]:
        short = tmp_path / f"short{cut}.gguf"
        short.write_bytes(head[:cut])
        with pytest.raises(ModelFileError, match=f"truncated GGUF file.*{what}"):
            GGUFFile(short)


# --- hostile containers: every count, length, offset and shape is checked ------------
# Files are built with the fuzzer's serializer (tests/gguf_fuzz.py), which writes
# exactly what it is given, lies included.


def small_doc() -> Doc:
    """Two F32 tensors (32 and 64 values) and a few keys; valid as it stands."""
    kvs = [KV(b"general.architecture", STR, b"qwen3"), KV(b"general.name", STR, b"t"),
           KV(b"some.ints", ARR, [1, 2, 3], I32),
           KV(b"some.strs", ARR, [b"a", b"bc"], STR),
           KV(b"qwen3.rope.freq_base", F32, 1e6)]
    tensors = [TInfo(b"a", [32], 0, 0), TInfo(b"b", [64], 0, 128)]
    return Doc(3, kvs, tensors, 32, bytes(128 + 256))


def write(tmp_path, doc_or_bytes, name="m.gguf"):
    path = tmp_path / name
    if not isinstance(doc_or_bytes, bytes):
        doc_or_bytes = serialize(doc_or_bytes)[0]
    path.write_bytes(doc_or_bytes)
    return path


def rejects(tmp_path, doc_or_bytes, match):
    with pytest.raises(ModelFileError, match=match):
        GGUFFile(write(tmp_path, doc_or_bytes))


def test_the_small_doc_is_valid(tmp_path):
    g = GGUFFile(write(tmp_path, small_doc()))
    assert g.get_array("some.ints").tolist() == [1, 2, 3]
    assert g.get_strings("some.strs") == [b"a", b"bc"]
    assert g.tensor("b").shape == (64,) and g.tensor("b").n_bytes == 256


@pytest.mark.parametrize("count", [2**31, 2**40, 2**64 - 1])
def test_huge_array_counts_are_checked_before_allocating(tmp_path, count):
    # The reference reader (and ours, before) called np.empty(count) first: 16 GiB and
    # up.
    for key in (b"some.ints", b"some.strs"):
        raw, fields = serialize(small_doc())
        f = next(f for f in fields if f.role == "count" and key.decode() in f.label)
        raw = raw[:f.offset] + count.to_bytes(8, "little") + raw[f.offset + 8:]
        rejects(tmp_path, raw, f"'{key.decode()}' claims {count:,} (value|string)s")


def test_lying_string_lengths(tmp_path):
    raw, fields = serialize(small_doc())
    for f in fields:
        if f.role in ("str_len", "key_len", "name_len"):
            for lie in (2**40, 2**64 - 1):
                bad = raw[:f.offset] + lie.to_bytes(8, "little") + raw[f.offset + 8:]
                rejects(tmp_path, bad, "runs? past the end of the file")


def test_truncation_at_every_structural_boundary(tmp_path):
    raw, fields = serialize(small_doc())
    data_start = next(f.offset for f in fields if f.role == "data")
    cuts = {f.offset for f in fields} | {f.offset + f.size for f in fields}
    for cut in sorted(c for c in cuts if c < data_start + 128 + 256):
        rejects(tmp_path, raw[:cut], "(truncated|not a GGUF file)")


def test_tensor_offsets_aligned_inside_and_in_order(tmp_path):
    for offset, match in [(129, "not a multiple of general.alignment"),
                          (100, "not a multiple of general.alignment"),
                          (64, "overlaps the tensor before it"),
                          (160, "leaves a gap"), (2**40, "leaves a gap")]:
        doc = small_doc()
        doc.tensors[1].offset = offset
        rejects(tmp_path, doc, match)
    doc = small_doc()  # the same two tensors, listed out of order
    doc.tensors.reverse()
    rejects(tmp_path, doc, "'b' starts at data offset 128 and leaves a gap")


def test_a_relabelled_type_of_another_size_is_caught_even_as_the_last_tensor(tmp_path):
    doc = small_doc()
    doc.tensors[0].ttype = 1  # F32 -> F16: 64 bytes, padded 64; 'b' expected at 64
    rejects(tmp_path, doc, "'b' starts at data offset 128 and leaves a gap")
    doc = small_doc()
    doc.tensors[1].ttype = 1  # the last one: its bytes end early, the file goes on
    rejects(tmp_path, doc, "128 bytes after the last tensor's data belong to no tensor")


def test_tensor_shapes_and_types(tmp_path):
    for dims, ttype, match in [
            ([32, 1, 1, 1, 1], 0, "'a' has 5 dimensions; GGUF allows at most 4"),
            ([2**32, 2**32], 0, "more elements than a 64-bit count holds"),
            ([32], 1000, "'a' has type id 1000, which is not a GGML type"),
            ([32], 4, "type id 4"),  # Q4_2: removed from GGML long ago
            ([16], 8, r"'a' \(Q8_0\) has rows of 16 values, not a whole number of 32")]:
        doc = small_doc()
        doc.tensors[0].dims, doc.tensors[0].ttype = dims, ttype
        rejects(tmp_path, doc, match)


def test_names_and_keys(tmp_path):
    cases = [
        (lambda d: setattr(d.tensors[1], "name", b"a"), "tensor 'a' appears twice"),
        (lambda d: setattr(d.tensors[1], "name", b""), "name is 0 bytes long"),
        (lambda d: setattr(d.tensors[1], "name", b"x" * 64), "name is 64 bytes long"),
        (lambda d: setattr(d.tensors[1], "name", b"\xff"), "name is not UTF-8"),
        (lambda d: d.kvs.append(KV(b"general.name", STR, b"x")),
         "'general.name' appears twice"),
        (lambda d: d.kvs.append(KV(b"", U32, 1)), "has an empty name"),
        (lambda d: d.kvs.append(KV(b"nested", ARR, [], ARR)), "array of arrays"),
        (lambda d: d.kvs.append(KV(b"odd", 13, 0)), "value type 13"),
        (lambda d: d.kvs.append(KV(b"general.alignment", U64, 32)),
         "'general.alignment' should be UINT32"),
        (lambda d: d.kvs.append(KV(b"general.alignment", U32, 48)),
         "general.alignment is 48; it must be a power of two"),
    ]
    for change, match in cases:
        doc = small_doc()
        change(doc)
        rejects(tmp_path, doc, match)


def test_header_version_and_byte_order(tmp_path):
    raw = serialize(small_doc())[0]
    for version, match in [(1, "version 1 is not supported"),
                           (4, "version 4 is not supported"),
                           (0x03000000, "big-endian GGUF file")]:
        rejects(tmp_path, raw[:4] + version.to_bytes(4, "little") + raw[8:], match)
    rejects(tmp_path, raw[:20], "header incomplete")
    doc = small_doc()
    doc.version = 2  # same layout as 3: accepted
    assert GGUFFile(write(tmp_path, doc)).tensor("a").shape == (32,)


def test_kv_and_tensor_counts_are_checked_against_the_bytes_left(tmp_path):
    raw, fields = serialize(small_doc())
    for role, match in [("kv_count", "claims 4,294,967,296 metadata keys"),
                        ("tensor_count", "claims 4,294,967,296 tensors")]:
        f = next(f for f in fields if f.role == role)
        bad = raw[:f.offset] + (2**32).to_bytes(8, "little") + raw[f.offset + 8:]
        rejects(tmp_path, bad, match)


def test_floats_must_be_stored_as_floats(tmp_path):
    doc = small_doc()
    doc.kvs[-1] = KV(b"qwen3.rope.freq_base", U32, 1_000_000)
    g = GGUFFile(write(tmp_path, doc))
    with pytest.raises(MetadataError, match="'qwen3.rope.freq_base' should be a float"):
        g.get_float("qwen3.rope.freq_base")


def test_zero_and_empty_tensors_do_not_divide_by_zero(tmp_path):
    doc = small_doc()
    doc.tensors[1].dims = [0, 64]
    doc.data = bytes(128)
    assert GGUFFile(write(tmp_path, doc)).tensor("b").rows == 0


def test_a_long_garbage_key_is_cut_in_the_message(tmp_path):
    doc = small_doc()
    doc.kvs.append(KV(b"k" * 5000, 13, 0))
    with pytest.raises(ModelFileError, match=r"'k{60}'\.\.\. \(5,000 characters\) has "
                                             "value type 13") as info:
        GGUFFile(write(tmp_path, doc))
    assert len(str(info.value)) < 300


def test_string_arrays_have_a_stated_limit(tmp_path, monkeypatch):
    from fucina_course import gguf_file

    monkeypatch.setattr(gguf_file, "MAX_STRING_ARRAY", 1)
    rejects(tmp_path, small_doc(), "'some.strs' holds 2 strings; at most 1 are")


def test_key_and_tensor_counts_have_stated_limits(tmp_path, monkeypatch):
    from fucina_course import gguf_file

    monkeypatch.setattr(gguf_file, "MAX_KEYS", 4)
    rejects(tmp_path, small_doc(), "claims 5 metadata keys; at most 4 are accepted")
    monkeypatch.setattr(gguf_file, "MAX_KEYS", 5)
    monkeypatch.setattr(gguf_file, "MAX_TENSORS", 1)
    rejects(tmp_path, small_doc(), "claims 2 tensors; at most 1 are accepted")
