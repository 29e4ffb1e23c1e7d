"""A seeded GGUF fuzzer: mutate small synthetic models, then use each as a user would.

A case is (base file, seed).  The seed picks a mutation kind (round-robin over KINDS, so
every kind is covered) and its parameters; the mutated bytes are written to a temporary
file, and a worker process runs what a user runs: `Model.load`, `tokenizer.encode`, a
prefill and one decode step (plus decoding the sampled token).  The outcome is one of

    clean              a FucinaError (the engine said no, in one line)
    accepted           loaded and ran, every logit finite
    accepted-nonfinite loaded and ran, NaN/inf logits handed back without a word
    other-exception    any other exception (a bug: the CLI would print a traceback)
    memory             MemoryError / ENOMEM: an allocation above the worker's limit
    crash              the worker died (segfault, abort)
    hang               the case exceeded its time budget

and a case *fails* on the last five, on a multi-line error message, on `accepted` when
the mutation must be rejected (a corrupt file accepted), and on `clean` when it must be
accepted (a valid file rejected: some mutations are benign on purpose, as controls).

Isolation: each worker is a separate process, so a segfault fails one case, not the run;
the parent restarts a worker that died or overran a case.  Each worker runs with
`RLIMIT_AS` = its own size after warm-up + 1 GiB, so any allocation above ~1 GiB fails
inside the case (`memory`), and with one numba/BLAS thread (two workers on two cores).

Command line (the test suite calls `run_fuzz` directly):

    python tests/gguf_fuzz.py --cases 1000 --seed 0 --workers 2 [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import resource
import selectors
import signal
import struct
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BASE_FORMATS = ("Q8_0", "Q4_K", "Q6_K", "F16")
PROMPT = "The capital of France is"
CASE_TIMEOUT = 30.0       # seconds per case (the machine may be shared)
MEMORY_HEADROOM = 1 << 30  # bytes a case may allocate above the warmed-up worker
# FUCINA_FUZZ_SIMULATE=1: call validate.py's checks where docs/RELIABILITY.md says
# Model.load and the forward pass will, to measure the engine once they are wired in.
SIMULATE = os.environ.get("FUCINA_FUZZ_SIMULATE") == "1"

# GGUF value types (gguf.GGUFValueType) and how each scalar is packed.
U8, I8, U16, I16, U32, I32, F32, BOOL, STR, ARR, U64, I64, F64 = range(13)
_PACK = {U8: "<B", I8: "<b", U16: "<H", I16: "<h", U32: "<I", I32: "<i", F32: "<f",
         BOOL: "<B", U64: "<Q", I64: "<q", F64: "<d"}
_INT_TYPES = (U8, I8, U16, I16, U32, I32, U64, I64)
_SIZE = {t: struct.calcsize(f) for t, f in _PACK.items()}


# --- the container as data ------------------------------------------------------------

@dataclass
class KV:
    key: bytes
    vtype: int
    value: object          # int/float/bool, bytes, or a list (arrays)
    itype: int | None = None


@dataclass
class TInfo:
    name: bytes
    dims: list[int]
    ttype: int
    offset: int


@dataclass
class Doc:
    """A GGUF file as editable data: serialize(doc) writes it back byte for byte."""

    version: int
    kvs: list[KV]
    tensors: list[TInfo]
    alignment: int
    data: bytes            # the data section (from the aligned end of the header)

    def copy(self) -> "Doc":
        kvs = [replace(kv, value=list(kv.value) if isinstance(kv.value, list)
                       else kv.value) for kv in self.kvs]
        tensors = [replace(t, dims=list(t.dims)) for t in self.tensors]
        return Doc(self.version, kvs, tensors, self.alignment, self.data)

    def kv(self, key: str) -> KV | None:
        return next((kv for kv in self.kvs if kv.key == key.encode()), None)

    def tensor(self, name: str) -> TInfo:
        return next(t for t in self.tensors if t.name == name.encode())


@dataclass(frozen=True)
class Field:
    """One structural field of a serialized file: where, how wide, what it is."""

    offset: int
    size: int
    role: str   # kv_count, tensor_count, key_len, vtype, itype, count, str_len,
    label: str  # value, name_len, n_dims, dim, ttype, toffset, data, tdata


def parse(path) -> Doc:
    """Read a *valid* base file with the reference reader (slow, but once per base)."""
    import gguf

    r = gguf.GGUFReader(path)
    kvs = []
    for name, f in r.fields.items():
        if name.startswith("GGUF."):
            continue
        vtype = int(f.types[0])
        if vtype == ARR:
            itype = int(f.types[1])
            if itype == STR:
                value = [bytes(f.parts[i]) for i in f.data]
            else:
                value = [f.parts[i][0].item() for i in f.data]
            kvs.append(KV(name.encode(), ARR, value, itype))
        elif vtype == STR:
            kvs.append(KV(name.encode(), STR, bytes(f.parts[-1])))
        else:
            kvs.append(KV(name.encode(), vtype, f.parts[-1][0].item()))
    tensors = [TInfo(t.name.encode(), [int(d) for d in t.shape], int(t.tensor_type),
                     int(t.data_offset - r.data_offset)) for t in r.tensors]
    raw = Path(path).read_bytes()
    version = struct.unpack_from("<I", raw, 4)[0]
    return Doc(version, kvs, tensors, int(r.alignment), raw[r.data_offset:])


def pack_scalar(vtype: int, value) -> bytes:
    """`value` packed as `vtype`, coerced the way a careless writer would."""
    if vtype in (F32, F64):
        return struct.pack(_PACK[vtype], float(value))
    if vtype == BOOL:
        return struct.pack("<B", 1 if value else 0)
    if vtype not in _PACK:  # a type GGUF does not define: some bytes all the same
        return bytes(4)
    bits = 8 * _SIZE[vtype]
    v = int(value) % (1 << bits)
    if vtype in (I8, I16, I32, I64) and v >= 1 << (bits - 1):
        v -= 1 << bits
    return struct.pack(_PACK[vtype], v)


def serialize(doc: Doc, *, record_strings: int = 5) -> tuple[bytes, list[Field]]:
    """The file's bytes and its structural fields (every count, length, tag, offset).

    `record_strings`: how many string lengths of each array to record (first, last and
    evenly spaced between): all 8k of a vocabulary would only slow the mutator down.
    """
    out: list[bytes] = []
    fields: list[Field] = []
    pos = 0

    def put(b: bytes, role: str | None = None, label: str = "") -> None:
        nonlocal pos
        if role:
            fields.append(Field(pos, len(b), role, label))
        out.append(b)
        pos += len(b)

    def put_str(s: bytes, role: str, label: str, record: bool = True) -> None:
        put(struct.pack("<Q", len(s)), role if record else None, label)
        put(s)

    put(b"GGUF")
    put(struct.pack("<I", doc.version), "version", "version")
    put(struct.pack("<Q", len(doc.tensors)), "tensor_count", "tensor count")
    put(struct.pack("<Q", len(doc.kvs)), "kv_count", "kv count")
    for kv in doc.kvs:
        key = kv.key.decode("utf-8", "replace")
        put_str(kv.key, "key_len", f"length of key {key!r}")
        put(struct.pack("<I", kv.vtype), "vtype", f"type of {key!r}")
        if kv.vtype == ARR:
            put(struct.pack("<I", kv.itype), "itype", f"item type of {key!r}")
            items = kv.value
            put(struct.pack("<Q", len(items)), "count", f"count of {key!r}")
            if kv.itype == STR:
                n = len(items)
                keep = ({0, n - 1} | {n * k // record_strings
                                      for k in range(record_strings)}) if n else set()
                for i, s in enumerate(items):
                    put_str(s, "str_len", f"{key!r}[{i}] length", i in keep)
            else:
                fmt = _PACK.get(kv.itype)
                put(b"".join(pack_scalar(kv.itype, v) for v in items) if fmt else b"",
                    "value", f"values of {key!r}")
        elif kv.vtype == STR:
            put_str(kv.value, "str_len", f"length of {key!r}'s value")
        else:
            put(pack_scalar(kv.vtype, kv.value), "value", f"value of {key!r}")
    for t in doc.tensors:
        name = t.name.decode("utf-8", "replace")
        put_str(t.name, "name_len", f"name length of {name!r}")
        put(struct.pack("<I", len(t.dims)), "n_dims", f"n_dims of {name!r}")
        for k, d in enumerate(t.dims):
            put(struct.pack("<Q", d % (1 << 64)), "dim", f"dim {k} of {name!r}")
        put(struct.pack("<I", t.ttype % (1 << 32)), "ttype", f"type of {name!r}")
        put(struct.pack("<Q", t.offset % (1 << 64)), "toffset", f"offset of {name!r}")
    pad = -pos % doc.alignment
    put(b"\0" * pad)
    fields.append(Field(pos, 0, "data", "data section"))
    for t in doc.tensors:
        fields.append(Field(pos + t.offset, 0, "tdata",
                            f"data of {t.name.decode('utf-8', 'replace')!r}"))
    put(doc.data)
    return b"".join(out), fields


def tensor_nbytes(dims: list[int], ttype: int) -> int | None:
    from gguf import GGMLQuantizationType
    from gguf.constants import GGML_QUANT_SIZES

    try:
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(ttype)]
    except (ValueError, KeyError):
        return None
    n = math.prod(dims)
    if not dims or dims[0] % block:
        return None
    return n // block * size


def data_end(doc: Doc) -> int:
    """Offset (from the data section) just past the last tensor's bytes (no padding)."""
    last = max(doc.tensors, key=lambda t: t.offset)
    return last.offset + tensor_nbytes(last.dims, last.ttype)


# --- mutations ------------------------------------------------------------------------

@dataclass
class Case:
    index: int
    base: int
    kind: str
    what: str
    must_reject: bool | None  # True: must be rejected; False: must load and run;
    data: bytes = field(repr=False, default=b"")  # None: either (if clean or finite)


HOSTILE_U64 = [0, 1, 2**31, 2**32 - 1, 2**32, 2**40, 2**63 - 1, 2**63, 2**64 - 1]


def _patch(raw: bytes, f: Field, value: int) -> bytes:
    width = f.size
    b = bytearray(raw)
    value %= 1 << (8 * width)
    b[f.offset:f.offset + width] = value.to_bytes(width, "little")
    return bytes(b)


def m_truncate(rng, doc, raw, fields):
    """Cut the file at a structural boundary (never past the last tensor's bytes)."""
    header_end = next(f.offset for f in fields if f.role == "data")
    limit = header_end + data_end(doc)
    points = sorted({f.offset for f in fields} | {f.offset + f.size for f in fields}
                    | {4, 8, 16, 24})
    cut = min(max(rng.choice(points) + rng.choice([0, 0, 0, 1, -1]), 0), limit - 1)
    return raw[:cut], f"truncated to {cut:,} of {len(raw):,} bytes", True


def m_lying_count(rng, doc, raw, fields):
    """A count or length field that lies (array counts, string lengths, n_dims, ...)."""
    roles = ("kv_count", "tensor_count", "count", "str_len", "key_len", "name_len",
             "n_dims")
    f = rng.choice([f for f in fields if f.role in roles])
    old = int.from_bytes(raw[f.offset:f.offset + f.size], "little")
    choices = [v for v in HOSTILE_U64 + [old - 1, old + 1, old * 2, old + 7]
               if v != old and v >= 0]
    new = rng.choice(choices)
    return _patch(raw, f, new), f"{f.label}: {old:,} -> {new:,}", True


def _same_kind_int(a: int, b: int) -> bool:
    return a in _INT_TYPES and b in _INT_TYPES and _SIZE[a] == _SIZE[b]


def m_type_tag(rng, doc, raw, fields):
    """A value-type tag overwritten in place (the value bytes stay as they were)."""
    f = rng.choice([f for f in fields if f.role in ("vtype", "itype")])
    old = int.from_bytes(raw[f.offset:f.offset + 4], "little")
    choices = [t for t in list(range(13)) + [13, 255, 2**31]
               if t != old and not _same_kind_int(old, t)]
    new = rng.choice(choices)
    return _patch(raw, f, new), f"{f.label}: {old} -> {new}", True


def m_wrong_type(rng, doc, raw, fields):
    """A known key re-encoded, consistently, as a value of the wrong kind."""
    d = doc.copy()
    kv = rng.choice(d.kvs)
    key = kv.key.decode()
    old = (kv.vtype, kv.itype)
    if kv.vtype == ARR:
        if kv.itype == STR:
            kv.itype, kv.value = I32, [len(s) for s in kv.value]
        else:
            kv.itype = rng.choice([F32, STR])
            kv.value = ([float(v) for v in kv.value] if kv.itype == F32
                        else [str(v).encode() for v in kv.value])
    elif kv.vtype == STR:
        kv.vtype, kv.value = rng.choice([(U32, len(kv.value)),
                                         (ARR, [kv.value])])
        if kv.vtype == ARR:
            kv.itype = STR
    elif kv.vtype in (F32, F64):
        kv.vtype, kv.value = rng.choice([U32, STR]), kv.value
        if kv.vtype == STR:
            kv.value = str(kv.value).encode()
        else:
            kv.value = int(kv.value) if math.isfinite(kv.value) else 0
    elif kv.vtype == BOOL:
        kv.vtype, kv.value = U8, int(kv.value)
    else:  # an integer
        kv.vtype = rng.choice([F32, STR, BOOL, ARR])
        if kv.vtype == STR:
            kv.value = str(kv.value).encode()
        elif kv.vtype == ARR:
            kv.itype, kv.value = U32, [kv.value]
    data, _ = serialize(d)
    return data, f"{key!r} re-encoded from {old} to {(kv.vtype, kv.itype)}", True


def m_benign(rng, doc, raw, fields):
    """Controls: changes that leave a valid file, which must load and run."""
    d = doc.copy()
    choice = rng.randrange(5)
    if choice == 0:
        vt = rng.choice([U8, I32, U64, F32, F64, BOOL, STR])
        value = b"hello" if vt == STR else 1
        d.kvs.insert(rng.randrange(len(d.kvs) + 1),
                     KV(f"fuzz.extra_{rng.randrange(1000)}".encode(), vt, value))
        what = "an unknown extra key"
    elif choice == 1:
        d.kvs.append(KV(b"general.alignment", U32, 32))
        what = "general.alignment = 32 stated explicitly"
    elif choice == 2:
        rng.shuffle(d.kvs)
        what = "metadata keys in another order"
    elif choice == 3:
        d.kv("general.name").value = bytes(rng.randrange(256) for _ in range(12))
        what = "general.name replaced by 12 random bytes"
    else:
        d.version = 2
        what = "GGUF version 2 (same layout as 3)"
    data, _ = serialize(d)
    return data, what, False


def m_alignment(rng, doc, raw, fields):
    """general.alignment that cannot describe this file."""
    d = doc.copy()
    vt, value = rng.choice([(U64, 32), (U32, 0), (U32, 3), (U32, 24), (U32, 2**31),
                            (I32, 32), (STR, b"32"), (U32, 8)])
    d.kvs.append(KV(b"general.alignment", vt, value))
    data, _ = serialize(d)
    return data, f"general.alignment = {value!r} as type {vt}", True


def m_tensor_dims(rng, doc, raw, fields):
    """A tensor's dimensions changed (its bytes and offsets left as they were)."""
    d = doc.copy()
    t = rng.choice(d.tensors)
    name, old = t.name.decode(), list(t.dims)
    variant = rng.randrange(6)
    if variant == 0:
        k = rng.randrange(len(t.dims))
        v = t.dims[k]
        values = (v - 1, v + 1, 2 * v, v // 2, 0, 2**40, 2**63)
        t.dims[k] = rng.choice([x for x in values if x != v])
    elif variant == 1:
        t.dims.append(1)
    elif variant == 2:
        t.dims += [1] * (5 - len(t.dims))
    elif variant == 3 and len(t.dims) == 2:
        t.dims = [t.dims[0] * t.dims[1]]
    else:
        t = rng.choice([x for x in d.tensors
                        if len(x.dims) == 2 and x.dims[0] != x.dims[1]])
        name, old = t.name.decode(), list(t.dims)
        t.dims.reverse()
    data, _ = serialize(d)
    return data, f"{name!r} dims {old} -> {t.dims}", True


def m_tensor_type(rng, doc, raw, fields):
    """A tensor relabelled to another GGML type (bytes unchanged)."""
    from gguf import GGMLQuantizationType

    d = doc.copy()
    t = rng.choice(d.tensors)
    old = t.ttype
    size = tensor_nbytes(t.dims, old)
    known = [int(x) for x in GGMLQuantizationType]
    pool = [x for x in known if x != old and tensor_nbytes(t.dims, x) != size]
    t.ttype = rng.choice(pool + [4, 5, 42, 1000, 2**31])
    data, _ = serialize(d)
    return data, f"{t.name.decode()!r} type {old} -> {t.ttype}", True


def m_tensor_offset(rng, doc, raw, fields):
    """A tensor's data offset moved: misaligned, overlapping, out of order, outside."""
    d = doc.copy()
    i = rng.randrange(len(d.tensors))
    t = d.tensors[i]
    old = t.offset
    variant = rng.randrange(6)
    if variant == 0:
        t.offset += rng.choice([1, 2, d.alignment // 2])
    elif variant == 1 and i > 0:
        t.offset = d.tensors[i - 1].offset
    elif variant == 2:
        t.offset += d.alignment
    elif variant == 3:
        t.offset = rng.choice([2**40, 2**63, 2**64 - 1 - d.alignment + 1, len(d.data)])
    else:
        same = [u for u in d.tensors if u is not t and u.dims == t.dims
                and u.ttype == t.ttype]
        if same:
            u = rng.choice(same)
            t.offset, u.offset = u.offset, t.offset
        else:
            t.offset = 0 if old else d.alignment
    if t.offset == old:
        t.offset = old + d.alignment
    data, _ = serialize(d)
    return data, f"{t.name.decode()!r} offset {old:,} -> {t.offset:,}", True


def m_tensor_name(rng, doc, raw, fields):
    """A tensor renamed: duplicate, unknown, empty, too long, not UTF-8, swapped."""
    d = doc.copy()
    t = rng.choice(d.tensors)
    old = t.name
    variant = rng.randrange(6)
    must = True
    if variant == 0:
        t.name = rng.choice([u.name for u in d.tensors if u is not t])
    elif variant == 1:
        t.name = rng.choice([b"blk.0.attn_qq.weight", b"blk.9.attn_q.weight",
                             b"rope_freqs.weight", old.upper()])
    elif variant == 2:
        t.name = b""
    elif variant == 3:
        t.name = b"blk.0." + b"x" * 60
    elif variant == 4:
        t.name = b"\xff\xfe" + old[2:]
    else:
        same = [u for u in d.tensors if u is not t and u.dims == t.dims
                and u.ttype == t.ttype]
        if not same:
            t.name = b""
        else:
            u = rng.choice(same)
            t.name, u.name = u.name, t.name
            must = None  # a valid file of another (swapped-weights) model
    data, _ = serialize(d)
    return data, f"tensor {old!r} renamed {t.name!r}", must


def m_tokenizer(rng, doc, raw, fields):
    """Broken tokenizer arrays: byte tokens, types, lengths, merges, special ids."""
    d = doc.copy()
    tokens = d.kv("tokenizer.ggml.tokens")
    types = d.kv("tokenizer.ggml.token_type")
    merges = d.kv("tokenizer.ggml.merges")
    n = len(tokens.value)
    k = rng.randrange(300, n - 3)
    variant = rng.randrange(13)
    must = True
    if variant == 0:
        spelling = rng.choice([b"<0x", b"<0xG1>", b"<0x41", b"<0x4142>", b"<0x>"])
        tokens.value[k], types.value[k] = spelling, 6
        what = f"token {k} = {spelling!r} typed BYTE"
    elif variant == 1:
        types.value[k] = rng.choice([7, 99, -1, 2**31 - 1])
        what = f"token_type[{k}] = {types.value[k]}"
    elif variant == 2:
        types.value = types.value[:-1] if rng.random() < 0.5 else types.value + [1]
        what = f"{len(types.value)} token types for {n} tokens"
    elif variant == 3:
        tokens.value = tokens.value[:-1]
        types.value = types.value[:-1]
        what = f"{n - 1} tokens for {n} embedding rows"
    elif variant == 4:
        j = rng.randrange(len(merges.value))
        merges.value[j] = rng.choice([b"zq\xc3\xbf\xc3\xbf qz", b"\xc4\xa0the zzzz"])
        what = f"merge {j} names an unknown token"
    elif variant == 5:
        j = rng.randrange(len(merges.value))
        merges.value[j] = merges.value[j].replace(b" ", b"")
        what = f"merge {j} has no space"
    elif variant == 6:
        key = rng.choice(["tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id"])
        d.kv(key).value = rng.choice([n, n + 5, 2**32 - 1])
        what = f"{key} = {d.kv(key).value} (vocabulary {n})"
    elif variant == 7:
        tokens.value, types.value, merges.value = [], [], []
        what = "empty vocabulary"
    elif variant == 8:
        d.kvs.remove(merges)
        what = "merges key removed"
    elif variant == 9:
        d.kv("tokenizer.ggml.model").value = rng.choice([b"llama", b"", b"bert"])
        what = f"tokenizer model {d.kv('tokenizer.ggml.model').value!r}"
    elif variant == 10:
        tokens.value[k], types.value[k] = b"<0x41>", 6
        what = f"token {k} = '<0x41>' typed BYTE (valid)"
        must = None
    elif variant == 11:
        tokens.value[k] = tokens.value[rng.randrange(300, n - 3)]
        what = f"token {k} duplicates another (llama.cpp accepts that)"
        must = None
    else:
        d.kvs.remove(types)
        what = "token_type key removed (markers inferred from <|...|>)"
        must = None
    data, _ = serialize(d)
    return data, what, must


def m_config(rng, doc, raw, fields):
    """Model hyper-parameters that contradict the tensors or leave sane ranges."""
    d = doc.copy()
    arch = d.kv("general.architecture").value.decode()

    def k(s):
        return d.kv(f"{arch}.{s}")

    variants = [
        ("block_count", [0, 1, 3, 2**31]), ("embedding_length", [255, 257, 512, 0]),
        ("attention.head_count", [3, 8, 0]), ("attention.head_count_kv", [3, 4, 0]),
        ("attention.key_length", [63, 32, 128, 0]), ("attention.value_length", [32]),
        ("feed_forward_length", [511, 1024, 0]),
        ("context_length", [0, 2**32 - 1]),
        ("rope.freq_base", [math.nan, math.inf, -1.0, 0.0]),
        ("attention.layer_norm_rms_epsilon", [math.nan, math.inf, -1e-6, 0.0, 2.0]),
    ]
    variant = rng.randrange(len(variants) + 4)
    if variant < len(variants):
        key, values = variants[variant]
        k(key).value = rng.choice(values)
        what = f"{arch}.{key} = {k(key).value}"
    elif variant == len(variants):
        new = rng.choice([b"gemma3", b"llama", b"qwen2", b"qwen3moe", b""])
        d.kv("general.architecture").value = new
        what = f"architecture {new!r}"
    elif variant == len(variants) + 1:
        key = rng.choice(["block_count", "embedding_length", "attention.head_count"])
        d.kvs.remove(k(key))
        what = f"{arch}.{key} removed"
    elif variant == len(variants) + 2:
        value = rng.choice([4095, 5000, 1])
        d.kvs.append(KV(f"{arch}.vocab_size".encode(), U32, value))
        what = f"{arch}.vocab_size = {value} added"
    else:
        d.kvs.append(KV(f"{arch}.rope.dimension_count".encode(), U32, 32))
        what = f"{arch}.rope.dimension_count = 32 (partial RoPE) added"
    data, _ = serialize(d)
    return data, what, True


def m_data(rng, doc, raw, fields):
    """Tensor bytes changed: NaN/inf in a norm (must never reach the sampler), noise."""
    import numpy as np

    header_end = next(f.offset for f in fields if f.role == "data")
    b = bytearray(raw)
    if rng.random() < 0.5:
        norms = [t for t in doc.tensors if t.ttype == 0]
        t = rng.choice(norms)
        j = rng.randrange(t.dims[0])
        value = rng.choice([np.nan, np.inf, -np.inf])
        at = header_end + t.offset + 4 * j
        b[at:at + 4] = np.float32(value).tobytes()
        return bytes(b), f"{t.name.decode()!r}[{j}] = {value}", True
    t = rng.choice(doc.tensors)
    n = tensor_nbytes(t.dims, t.ttype)
    for _ in range(rng.randrange(1, 9)):
        b[header_end + t.offset + rng.randrange(n)] = rng.randrange(256)
    return bytes(b), f"random bytes in {t.name.decode()!r}", None


def m_header(rng, doc, raw, fields):
    """Magic and version."""
    b = bytearray(raw)
    if rng.random() < 0.4:
        b[:4] = rng.choice([b"GGUG", b"\0GUF", b"GGML", b"gguf"])
        return bytes(b), f"magic {bytes(b[:4])!r}", True
    v = rng.choice([0, 1, 4, 0x03000000, 2**32 - 1])
    b[4:8] = v.to_bytes(4, "little")
    return bytes(b), f"version {v:#x}", True


def m_raw_flip(rng, doc, raw, fields):
    """Random bytes anywhere in the header (metadata and tensor table)."""
    header_end = next(f.offset for f in fields if f.role == "data")
    b = bytearray(raw)
    spots = []
    for _ in range(rng.randrange(1, 5)):
        at = rng.randrange(24, header_end)
        b[at] = rng.randrange(256)
        spots.append(at)
    return bytes(b), f"bytes at {spots} randomised", None


KINDS = {
    "truncate": m_truncate, "lying_count": m_lying_count, "type_tag": m_type_tag,
    "wrong_type": m_wrong_type, "benign": m_benign, "alignment": m_alignment,
    "tensor_dims": m_tensor_dims, "tensor_type": m_tensor_type,
    "tensor_offset": m_tensor_offset, "tensor_name": m_tensor_name,
    "tokenizer": m_tokenizer, "config": m_config, "data": m_data, "header": m_header,
    "raw_flip": m_raw_flip,
}


class Mutator:
    """Holds the parsed bases; `case(i)` is deterministic in (seed, i)."""

    def __init__(self, bases: list[Path], seed: int):
        self.seed = seed
        self.docs = [parse(p) for p in bases]
        self.raws, self.fields = [], []
        for doc, p in zip(self.docs, bases):
            raw, fields = serialize(doc)
            if raw != Path(p).read_bytes():
                raise RuntimeError(f"{p}: the serializer does not reproduce it")
            self.raws.append(raw)
            self.fields.append(fields)

    def case(self, i: int) -> Case:
        kinds = list(KINDS)
        kind = kinds[i % len(kinds)]
        base = (i // len(kinds)) % len(self.docs)
        rng = random.Random(f"{self.seed}:{i}")
        data, what, must = KINDS[kind](rng, self.docs[base], self.raws[base],
                                       self.fields[base])
        return Case(i, base, kind, what, must, data)


# --- running one case (inside a worker) -----------------------------------------------

def run_user_flow(path: Path) -> str:
    """What a user does with a model file: 'accepted' or 'accepted-nonfinite'."""
    import numpy as np

    from fucina_course import Model

    if SIMULATE:
        _simulated_load_checks(path)
    model = Model.load(path)
    tok = model.tokenizer
    ids = tok.encode(PROMPT) if tok is not None else [1, 2, 3]
    cache = model.new_cache()
    first = _step(model, ids, 0, cache)
    nxt = int(np.argmax(first))
    if tok is not None:
        tok.decode([nxt])
    second = _step(model, [nxt], cache.len, cache)
    finite = bool(np.isfinite(first).all() and np.isfinite(second).all())
    return "accepted" if finite else "accepted-nonfinite"


def _simulated_load_checks(path: Path) -> None:
    from fucina_course import validate
    from fucina_course.config import Config
    from fucina_course.gguf_file import GGUFFile
    from fucina_course.tokenizer import Tokenizer

    g = GGUFFile(path)
    validate.check_metadata(g)
    cfg = Config.from_gguf(g)
    tok = Tokenizer.from_gguf(g) if g.has("tokenizer.ggml.tokens") else None
    validate.check_model_file(g, cfg, tok)


def _step(model, ids, pos0, cache):
    if not SIMULATE:
        return model.forward_step(ids, pos0, cache)
    from fucina_course import validate
    from fucina_course.errors import NonFiniteValues

    try:
        logits = model.forward_step(ids, pos0, cache)
    except (ZeroDivisionError, FloatingPointError):  # a non-finite activation
        raise NonFiniteValues("a hidden state went non-finite") from None
    return validate.check_logits(logits)


def classify(path: Path) -> dict:
    from fucina_course.errors import FucinaError

    try:
        return {"outcome": run_user_flow(path)}
    except FucinaError as e:
        msg = str(e)
        return {"outcome": "clean", "error": type(e).__name__, "message": msg,
                "multiline": "\n" in msg or "\r" in msg}
    except MemoryError as e:
        return {"outcome": "memory", "error": type(e).__name__, "message": str(e)[:300]}
    except Exception as e:  # noqa: BLE001 - the point is to see every escape
        if isinstance(e, OSError) and e.errno == 12:
            return {"outcome": "memory", "error": "OSError(ENOMEM)", "message": str(e)}
        tb = traceback.format_exception(type(e), e, e.__traceback__)
        return {"outcome": "other-exception", "error": type(e).__name__,
                "message": str(e)[:300], "where": "".join(tb[-3:])[-900:]}


def _vm_size() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


def worker_main(bases: list[str], seed: int) -> None:
    """Warm up on the valid bases, cap the address space, serve cases from stdin."""
    import logging

    logging.disable(logging.WARNING)  # a mutated pretokenizer name warns; keep quiet
    out = sys.stdout
    tmp = Path(tempfile.mkdtemp(prefix="fucina-fuzz-"))
    for p in bases:
        if run_user_flow(Path(p)) != "accepted":
            raise RuntimeError(f"{p}: the valid base does not run cleanly")
    mutator = Mutator([Path(p) for p in bases], seed)
    limit = _vm_size() + MEMORY_HEADROOM
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    out.write(json.dumps({"ready": True, "limit": limit}) + "\n")
    out.flush()
    for line in sys.stdin:
        i = int(line)
        case = mutator.case(i)
        out.write(json.dumps({"start": i, "kind": case.kind, "what": case.what,
                              "must_reject": case.must_reject}) + "\n")
        out.flush()
        path = tmp / f"case{i}.gguf"
        path.write_bytes(case.data)
        t0 = time.perf_counter()
        result = classify(path)
        result.update(case=i, seconds=round(time.perf_counter() - t0, 4))
        path.unlink()
        out.write(json.dumps(result) + "\n")
        out.flush()


# --- the parent: a pool of restartable workers ----------------------------------------

class _Worker:
    def __init__(self, bases, seed, env, log_dir):
        self.log = open(log_dir / f"worker-{time.monotonic_ns()}.log", "wb")
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--worker", "--seed",
             str(seed), *map(str, bases)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, env=env,
            cwd=ROOT)
        self.buf = b""
        self.ready = False
        self.case: int | None = None
        self.meta: dict = {}
        self.started = 0.0

    def lines(self) -> list[dict] | None:
        """New complete lines, or None at end of file (the worker is gone)."""
        chunk = os.read(self.proc.stdout.fileno(), 1 << 16)
        if not chunk:
            return None
        self.buf += chunk
        *done, self.buf = self.buf.split(b"\n")
        return [json.loads(x) for x in done if x.strip()]

    def send(self, i: int) -> None:
        self.case, self.meta, self.started = i, {}, time.monotonic()
        self.proc.stdin.write(f"{i}\n".encode())
        self.proc.stdin.flush()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()  # our own child, by its handle
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            f.close()
        self.log.close()


def worker_env() -> dict:
    env = dict(os.environ)
    env.update(NUMBA_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]))
    return env


def run_fuzz(bases: list[Path], cases: int, seed: int = 0, workers: int = 2,
             timeout: float = CASE_TIMEOUT, log_dir: Path | None = None) -> dict:
    """Run cases 0..cases-1 on `workers` processes: {"results", "seconds", ...}."""
    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="fucina-fuzz-logs-"))
    env = worker_env()
    sel = selectors.DefaultSelector()
    pending = list(range(cases))[::-1]
    results: dict[int, dict] = {}
    t0 = time.monotonic()
    pool: list[_Worker] = []
    restarts = 0

    def spawn() -> _Worker:
        w = _Worker(bases, seed, env, log_dir)
        sel.register(w.proc.stdout, selectors.EVENT_READ, w)
        pool.append(w)
        return w

    def retire(w: _Worker) -> None:
        sel.unregister(w.proc.stdout)
        w.kill()
        pool.remove(w)

    def record(w: _Worker, outcome: str, **extra) -> None:
        results[w.case] = {"case": w.case, "outcome": outcome, **w.meta, **extra}
        w.case = None

    for _ in range(workers):
        spawn()
    warmup_deadline = time.monotonic() + 600
    while len(results) < cases:
        for w in list(pool):
            if w.ready and w.case is None and pending:
                w.send(pending.pop())
        for key, _ in sel.select(timeout=0.5):
            w = key.data
            got = w.lines()
            if got is None:  # the worker died
                if not w.ready:
                    raise RuntimeError(f"a fuzz worker died while warming up (log: "
                                       f"{w.log.name})")
                code = w.proc.wait()
                sig = -code if code < 0 else None
                record(w, "crash", returncode=code,
                       signal=signal.Signals(sig).name if sig else None)
                retire(w)
                restarts += 1
                spawn()
                continue
            for msg in got:
                if "ready" in msg:
                    w.ready = True
                    w.limit = msg["limit"]
                elif "start" in msg:
                    w.meta = {k: msg[k] for k in ("kind", "what", "must_reject")}
                else:
                    record(w, msg.pop("outcome"), **msg)
        now = time.monotonic()
        for w in list(pool):
            if w.case is not None and now - w.started > timeout:
                record(w, "hang", seconds=round(now - w.started, 1))
                retire(w)
                restarts += 1
                spawn()
            elif not w.ready and now > warmup_deadline:
                raise RuntimeError("fuzz workers did not warm up within 10 minutes")
    for w in list(pool):
        retire(w)
    ordered = [results[i] for i in range(cases)]
    for r in ordered:
        r["verdict"] = verdict(r)
    return {"results": ordered, "seconds": time.monotonic() - t0, "restarts": restarts,
            "workers": workers, "seed": seed, "bases": [str(b) for b in bases]}


def verdict(r: dict) -> str:
    """'ok', or why the case fails the engine's promise."""
    outcome, must = r["outcome"], r.get("must_reject")
    if outcome in ("crash", "hang", "other-exception", "memory", "accepted-nonfinite"):
        return outcome
    if outcome == "clean" and r.get("multiline"):
        return "multi-line error"
    if outcome == "accepted" and must is True:
        return "corrupt file accepted"
    if outcome == "clean" and must is False:
        return "valid file rejected"
    return "ok"


def summarize(report: dict) -> dict:
    res = report["results"]
    by_kind: dict[str, Counter] = {}
    for r in res:
        by_kind.setdefault(r.get("kind", "?"), Counter())[r["outcome"]] += 1
    return {"cases": len(res), "seconds": round(report["seconds"], 1),
            "simulated_wiring": SIMULATE,
            "restarts": report["restarts"],
            "outcomes": dict(Counter(r["outcome"] for r in res)),
            "verdicts": dict(Counter(r["verdict"] for r in res)),
            "by_kind": {k: dict(v) for k, v in sorted(by_kind.items())},
            "errors": dict(Counter(r.get("error") for r in res if r.get("error")))}


def failures(report: dict, limit: int = 30) -> list[str]:
    out = []
    for r in report["results"]:
        if r["verdict"] != "ok":
            detail = r.get("message") or r.get("signal") or ""
            out.append(f"case {r['case']} [{r.get('kind')}] {r.get('what')}: "
                       f"{r['verdict']} {r.get('error', '')} {detail}".strip()[:400])
    return out[:limit]


def base_paths() -> list[Path]:
    """The synthetic bases (written once into the cache dir, ~2 s each)."""
    from fucina_course.synth import TINY_QWEN3, cached_synthetic, with_format

    return [cached_synthetic(with_format(TINY_QWEN3, fmt)) for fmt in BASE_FORMATS]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("bases", nargs="*", help=argparse.SUPPRESS)
    ap.add_argument("--cases", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--json", help="write the full report here")
    args = ap.parse_args(argv)
    if args.worker:
        worker_main(args.bases, args.seed)
        return 0
    report = run_fuzz(base_paths(), args.cases, args.seed, args.workers)
    print(json.dumps(summarize(report), indent=1))
    for line in failures(report):
        print(line)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
