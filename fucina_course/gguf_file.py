"""Open a GGUF file: memory-mapped tensors plus typed, validated metadata.

The container is parsed by the `gguf` package's `GGUFReader` (the reference reader
maintained next to llama.cpp), subclassed here for three reasons:

* **Speed.**  `GGUFReader` turns every element of every metadata array into its own
  pair of numpy views.  A Qwen vocabulary is two arrays of ~151k strings, so opening
  the 0.5B Qwen2.5-Coder file took ~15 s here, almost all of it in that loop.
  `_CheckedReader` parses arrays of numbers as a single numpy view and walks arrays of
  strings once with `struct` (an offset table, ~0.1 s for 300k strings); per-element
  views are made only if somebody asks.  Opening the same file takes ~0.1 s.
* **A model file is untrusted input.**  Every count, length, offset and shape in the
  file is treated as hostile until checked, and checked *before* anything is allocated
  from it: a metadata array claiming 2^40 elements is compared with the bytes that
  remain (the reference reader would first ask numpy for terabytes).  The container
  rules are llama.cpp's (`gguf_init_from_file`), so a file one engine rejects the other
  rejects too: version 2 or 3, little-endian; non-empty unique UTF-8 keys; no arrays of
  arrays; unique tensor names under 64 bytes; at most 4 dimensions; a known GGML type
  whose block divides the row; each tensor's offset aligned to `general.alignment` and
  exactly where the previous tensor's padded bytes end (the data section is the
  tensors, in table order, nothing else: this is what catches a type relabelled to one
  of another size); every byte inside the file.  Bytes after the last tensor beyond its
  padding are an error too: only a lying tensor table leaves them.  Beyond llama.cpp's
  rules, stated limits bound what a big hostile file can make us allocate (MAX_* below:
  2^24 strings per array, 2^16 keys, 2^16 tensors).
* **Typed getters.**  `get_int`, `get_float`, `get_str`, `get_bool`, `get_array`,
  `get_strings` check the stored type and raise `MetadataError` naming the file and the
  key.  Structural integers (layer count, head count, ...) are read with
  `positive=True`: a present-but-zero value can only be a broken file.  Floats must be
  stored as floats (llama.cpp's rule): an integer where a float belongs is a type
  confusion, not a value.

Every failure is a `ModelFileError` (container) or `MetadataError` (a key) with one
sentence naming the file and the key or tensor.  Whether the tensors are the ones a
model needs is the next layer's question (validate.py).
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType
from gguf.constants import GGML_QUANT_SIZES
from gguf.gguf_reader import ReaderField

from .errors import MetadataError, ModelFileError

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
MAX_DIMS = 4                 # GGML_MAX_DIMS
MAX_NAME_BYTES = 63          # GGML_MAX_NAME - 1 (the C struct keeps a terminating NUL)
MAX_STRING_BYTES = 1 << 30   # llama.cpp's GGUF_MAX_STRING_LENGTH
MAX_STRING_ARRAY = 1 << 24   # strings per array (ours: bounds the offset tables to
                             # 256 MiB; the longest real array, a vocabulary, is ~262k)
MAX_KEYS = 1 << 16           # metadata keys, and tensors (ours: each costs Python
MAX_TENSORS = 1 << 16        # objects; real files have ~50 keys and <= ~2,000 tensors)
_MIN_KV_BYTES = 14           # key length 8 + key >= 1 + type 4 + smallest value 1
_MIN_TENSOR_INFO_BYTES = 25  # name length 8 + name >= 1 + n_dims 4 + type 4 + offset 8
_U64 = struct.Struct("<Q")
_INT_TYPES = {
    GGUFValueType.UINT8, GGUFValueType.INT8, GGUFValueType.UINT16,
    GGUFValueType.INT16, GGUFValueType.UINT32, GGUFValueType.INT32,
    GGUFValueType.UINT64, GGUFValueType.INT64,
}
_FLOAT_TYPES = {GGUFValueType.FLOAT32, GGUFValueType.FLOAT64}


class _LazyStringParts(Sequence):
    """The `parts` list of a string-array field, materialised on demand.

    `GGUFReader` represents a string array as [item_type, count, len_0, bytes_0, len_1,
    bytes_1, ...] and `ReaderField.contents()` indexes into that list.  We keep the same
    indexing contract (so the reader's own `contents()` still works) but build the two
    views of element i only when asked.
    """

    def __init__(self, data: np.ndarray, head: list[np.ndarray], starts: np.ndarray,
                 lengths: np.ndarray):
        self._data, self._head, self.starts, self.lengths = data, head, starts, lengths

    def prepend(self, parts: list[np.ndarray]) -> None:
        self._head = list(parts) + self._head

    def __len__(self) -> int:
        return len(self._head) + 2 * len(self.starts)

    def __getitem__(self, k):  # type: ignore[override]
        if isinstance(k, slice):
            return [self[i] for i in range(*k.indices(len(self)))]
        if k < 0:
            k += len(self)
        if k < len(self._head):
            return self._head[k]
        i, is_bytes = divmod(k - len(self._head), 2)
        start, length = int(self.starts[i]), int(self.lengths[i])
        if is_bytes:
            return self._data[start:start + length]
        return self._data[start - 8:start].view(np.uint64)


class _Corrupt(Exception):
    """A container rule is broken; the message says where (GGUFFile adds the path)."""


class _Truncated(_Corrupt):
    """Something the file declares lies (partly) past its last byte."""


@dataclass(frozen=True)
class _TensorEntry:
    name: str
    ggml_type: GGMLQuantizationType
    shape: tuple[int, ...]
    n_bytes: int
    start: int  # absolute file offset


def _pad(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment


def _show(name: str, limit: int = 60) -> str:
    """A key or tensor name for a one-line message: quoted, and cut if a file made it
    long (a key may legally run to 1 GiB; an error message should not)."""
    if len(name) <= limit:
        return repr(name)
    return f"{name[:limit]!r}... ({len(name):,} characters)"


class _CheckedReader(GGUFReader):
    """`GGUFReader` with bounded, checked parsing (see the module docstring).

    The base class's `__init__` drives the walk (magic, version, counts, fields, tensor
    table, alignment, data section); every method it calls to read something is
    overridden here.  `_where` names what is being read, for the error message.
    """

    def __init__(self, path: Path):
        self._where = "the header"
        self.table: list[_TensorEntry] = []
        super().__init__(path, "r")

    # --- primitive reads ------------------------------------------------------------

    def _get(self, offset, dtype, count=1, override_order=None):
        # Every read of the container goes through here: past the end is truncation.
        end = int(offset) + np.dtype(dtype).itemsize * int(count)
        if end > len(self.data):
            raise _Truncated(f"{self._where} runs past the end of the file")
        return super()._get(offset, dtype, count, override_order)

    def _get_str(self, offset: int):
        slen = self._get(offset, np.uint64)
        n = int(slen[0])
        if n > min(MAX_STRING_BYTES, len(self.data) - offset - 8):
            raise _Truncated(f"{self._where}: a string of {n:,} bytes runs past the "
                             "end of the file")
        return slen, self._get(offset + 8, np.uint8, n)

    def _value_type(self, raw) -> GGUFValueType:
        try:
            return GGUFValueType(int(raw))
        except ValueError:
            raise _Corrupt(f"{self._where} has value type {int(raw)}, which GGUF does "
                           "not define") from None

    # --- metadata ---------------------------------------------------------------------

    def _get_field_parts(self, orig_offs: int, raw_type: int):
        gtype = self._value_type(raw_type)
        if gtype != GGUFValueType.ARRAY:
            return super()._get_field_parts(orig_offs, gtype)
        offs = orig_offs
        raw_itype = self._get(offs, np.uint32)
        alen = self._get(offs + 4, np.uint64)
        offs += 12
        count = int(alen[0])
        itype = self._value_type(raw_itype[0])
        remaining = len(self.data) - offs
        if itype == GGUFValueType.ARRAY:
            raise _Corrupt(f"{self._where} is an array of arrays (no model file has "
                           "one; llama.cpp rejects them too)")
        if itype == GGUFValueType.STRING:
            # Checked before allocating: each string costs at least its 8-byte length.
            if count > remaining // 8:
                raise _Truncated(f"{self._where} claims {count:,} strings but only "
                                 f"{remaining:,} bytes follow")
            if count > MAX_STRING_ARRAY:
                raise _Corrupt(f"{self._where} holds {count:,} strings; at most "
                               f"{MAX_STRING_ARRAY:,} are accepted")
            # The walk keeps only the lengths (a list append is cheaper than a numpy
            # store; the starts are a cumulative sum afterwards): ~25 ms per 151k
            # strings, against ~36 ms for filling two preallocated arrays.
            lengths: list[int] = []
            keep, first = lengths.append, offs
            buf, unpack, end = memoryview(self.data), _U64.unpack_from, len(self.data)
            try:
                for _ in range(count):
                    (n,) = unpack(buf, offs)
                    keep(n)
                    offs += 8 + n
            except (struct.error, OverflowError):
                offs = end + 1  # a length ran past the end (or past 2^63)
            if offs > end:
                raise _Truncated(f"{self._where}: its strings run past the end of the "
                                 "file")
            sizes = np.array(lengths, dtype=np.int64)  # all < file size: no overflow
            starts = np.empty(count, dtype=np.int64)
            if count:
                starts[0] = first + 8
                np.cumsum(sizes[:-1] + 8, out=starts[1:])
                starts[1:] += first + 8
            parts = _LazyStringParts(self.data, [raw_itype, alen], starts, sizes)
            idxs = range(3, 3 + 2 * count, 2)  # lazy: contents() indexes it like a list
            return offs - orig_offs, parts, idxs, [GGUFValueType.ARRAY, itype]
        nptype = self.gguf_scalar_to_np[itype]
        size = np.dtype(nptype).itemsize
        if count > remaining // size:
            raise _Truncated(f"{self._where} claims {count:,} values of {size} bytes "
                             f"but only {remaining:,} bytes follow")
        values = self._get(offs, nptype, count)
        offs += int(values.nbytes)
        return (offs - orig_offs, [raw_itype, alen, values], [2],
                [GGUFValueType.ARRAY, itype])

    def _check_count(self, count, offs: int, min_bytes: int, limit: int,
                     what: str) -> int:
        """A header's item count, checked before anything is allocated for it: each
        item takes at least `min_bytes`, so they must fit in what is left of the file,
        and there may be at most `limit` of them."""
        count = int(count)
        remaining = len(self.data) - offs
        if count > remaining // min_bytes:
            raise _Truncated(f"the header claims {count:,} {what} but only "
                             f"{remaining:,} bytes follow")
        if count > limit:
            raise _Corrupt(f"the header claims {count:,} {what}; at most {limit:,} "
                           "are accepted")
        return count

    def _name_at(self, offs: int, whose: str):
        """The UTF-8 name (of a key or tensor) at `offs`: (its length part, its bytes
        part, the text, the offset after it)."""
        length, data = self._get_str(offs)
        try:
            text = bytes(data).decode("utf-8")
        except UnicodeDecodeError:
            raise _Corrupt(f"{whose}'s name is not UTF-8") from None
        return length, data, text, offs + 8 + int(data.nbytes)

    def _build_fields(self, offs: int, count: int) -> int:
        # Same walk as GGUFReader._build_fields, plus llama.cpp's key rules, and a lazy
        # string-array part list is kept lazy (the base class would materialise it).
        count = self._check_count(count, offs, _MIN_KV_BYTES, MAX_KEYS, "metadata keys")
        for i in range(count):
            orig_offs = offs
            self._where = f"metadata key #{i}"
            kv_klen, kv_kdata, key, offs = self._name_at(offs, f"metadata key #{i}")
            if not key:
                raise _Corrupt(f"metadata key #{i} has an empty name")
            if key in self.fields:
                raise _Corrupt(f"metadata key {_show(key)} appears twice")
            self._where = f"metadata key {_show(key)}"
            raw_kv_type = self._get(offs, np.uint32)
            offs += 4
            key_parts = [kv_klen, kv_kdata, raw_kv_type]
            size, parts, idxs, types = self._get_field_parts(offs, raw_kv_type[0])
            if isinstance(parts, _LazyStringParts):
                parts.prepend(key_parts)
                idxs = range(idxs.start + 3, idxs.stop + 3, idxs.step)
            else:
                parts = key_parts + parts
                idxs = [j + 3 for j in idxs]
            self._push_field(ReaderField(orig_offs, key, parts, idxs, types),
                             skip_sum=True)
            offs += size
        return offs

    # --- tensors ----------------------------------------------------------------------

    def _check_alignment(self) -> None:
        field = self.fields.get("general.alignment")
        if field is None:
            return
        if field.types != [GGUFValueType.UINT32]:
            got = "/".join(t.name for t in field.types)
            raise _Corrupt(f"metadata key 'general.alignment' should be UINT32, is "
                           f"{got}")
        value = int(field.parts[-1][0])
        if value == 0 or value & (value - 1):
            raise _Corrupt(f"general.alignment is {value}; it must be a power of two")

    def _build_tensor_info(self, offs: int, count: int):
        self._check_alignment()  # before the base class reads it, for a clearer message
        count = self._check_count(count, offs, _MIN_TENSOR_INFO_BYTES, MAX_TENSORS,
                                  "tensors")
        fields, names = [], set()
        for i in range(count):
            orig_offs = offs
            self._where = f"tensor #{i}'s name"
            name_len, name_data, name, offs = self._name_at(offs, f"tensor #{i}")
            if not name or len(name_data) > MAX_NAME_BYTES:
                raise _Corrupt(f"tensor #{i}'s name is {len(name_data)} bytes long; "
                               f"it must be 1 to {MAX_NAME_BYTES}")
            if name in names:
                raise _Corrupt(f"tensor {name!r} appears twice")
            names.add(name)
            self._where = f"tensor {name!r}"
            n_dims = self._get(offs, np.uint32)
            offs += 4
            if int(n_dims[0]) > MAX_DIMS:
                raise _Corrupt(f"tensor {name!r} has {int(n_dims[0]):,} dimensions; "
                               f"GGUF allows at most {MAX_DIMS}")
            dims = self._get(offs, np.uint64, int(n_dims[0]))
            offs += int(dims.nbytes)
            raw_dtype = self._get(offs, np.uint32)
            offset = self._get(offs + 4, np.uint64)
            offs += 12
            parts = [name_len, name_data, n_dims, dims, raw_dtype, offset]
            fields.append(ReaderField(orig_offs, name, parts, [1, 3, 4, 5]))
        return offs, fields

    def _build_tensors(self, start_offs: int, fields: list) -> None:
        # The data section holds the tensors in table order, each padded to the
        # alignment: llama.cpp refuses any other layout, so any other is a broken table.
        align, size = int(self.alignment), len(self.data)
        expected, previous = 0, None
        for field in fields:
            name = field.name
            _len, _name, _nd, dims, raw_dtype, offset = field.parts
            shape = tuple(int(d) for d in dims)
            n_elements = 1
            for d in shape:
                n_elements *= d
            if any(d >= 1 << 63 for d in shape) or n_elements >= 1 << 63:
                raise _Corrupt(f"tensor {name!r} has shape {list(shape)}: more "
                               "elements than a 64-bit count holds")
            try:
                ggml_type = GGMLQuantizationType(int(raw_dtype[0]))
                block, type_size = GGML_QUANT_SIZES[ggml_type]
            except (ValueError, KeyError):
                raise _Corrupt(f"tensor {name!r} has type id {int(raw_dtype[0])}, "
                               "which is not a GGML type") from None
            row = shape[0] if shape else 1
            if row % block:
                raise _Corrupt(f"tensor {name!r} ({ggml_type.name}) has rows of {row} "
                               f"values, not a whole number of {block}-value blocks")
            n_bytes = n_elements // block * type_size
            off = int(offset[0])
            if off % align:
                raise _Corrupt(f"tensor {name!r} starts at data offset {off:,}, not a "
                               f"multiple of general.alignment ({align})")
            if off != expected:
                after = (f"where {previous!r} ends" if previous
                         else "the data section's start")
                how = ("overlaps the tensor before it" if off < expected
                       else "leaves a gap")
                raise _Corrupt(f"tensor {name!r} starts at data offset {off:,} and "
                               f"{how}: tensors follow each other in table order, so "
                               f"it should start at {expected:,} ({after})")
            end = start_offs + off + n_bytes
            if end > size:
                raise _Truncated(f"tensor {name!r} ends at byte {end:,}, the file has "
                                 f"{size:,}")
            self.table.append(
                _TensorEntry(name, ggml_type, shape, n_bytes, start_offs + off))
            expected, previous = off + _pad(n_bytes, align), name
        if size > start_offs + expected:
            extra = size - start_offs - expected
            raise _Corrupt(f"{extra:,} bytes after the last tensor's data belong to no "
                           "tensor (the tensor table and the file disagree: a changed "
                           "type, shape or count?)")
        self.tensors = []  # TensorInfo objects are built by GGUFFile from `table`


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of the file, still in its on-disk block format.

    `shape` is in GGML order: `shape[0]` is the contiguous (innermost) dimension, so a
    weight matrix with `shape == (n_in, n_out)` holds `n_out` rows of `n_in` values
    each.  `data` is a read-only uint8 view of the memory-mapped bytes; nothing is
    copied.
    """

    name: str
    ggml_type: GGMLQuantizationType
    shape: tuple[int, ...]
    n_bytes: int
    data: np.ndarray

    @property
    def type_name(self) -> str:
        return self.ggml_type.name

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def rows(self) -> int:
        """Number of rows (product of all dimensions but the innermost)."""
        return self.n_elements // self.shape[0] if self.shape and self.shape[0] else 0


class GGUFFile:
    """A GGUF file opened read-only and memory-mapped.  See the module docstring."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        _check_path(self.path)
        try:
            self._reader = _CheckedReader(self.path)
        except _Truncated as e:
            raise ModelFileError(f"{self.path}: truncated GGUF file ({e})") from None
        except _Corrupt as e:
            raise ModelFileError(f"{self.path}: corrupt GGUF file ({e})") from None
        except (ValueError, KeyError, OverflowError, IndexError, struct.error) as e:
            # The base class's own checks (it runs the walk): still a broken file.
            raise ModelFileError(f"{self.path}: corrupt GGUF file ({e})") from None
        self.size = self.path.stat().st_size
        self.alignment = int(self._reader.alignment)
        self.data_offset = int(self._reader.data_offset)
        self.fields = self._reader.fields
        self.tensors: dict[str, TensorInfo] = {}
        data = self._reader.data
        for t in self._reader.table:
            self.tensors[t.name] = TensorInfo(
                name=t.name, ggml_type=t.ggml_type, shape=t.shape, n_bytes=t.n_bytes,
                data=data[t.start:t.start + t.n_bytes])

    # --- metadata ---------------------------------------------------------------------

    def has(self, key: str) -> bool:
        return key in self.fields

    def mapped_base(self) -> int:
        """The address of the file's byte 0 in the memory map: a tensor view's
        address minus this is its offset in the file (expert_cache.py reads there)."""
        return self._reader.data.__array_interface__["data"][0]

    def _field(self, key: str):
        field = self.fields.get(key)
        if field is None:
            raise MetadataError(f"{self.path}: metadata key {key!r} is missing")
        return field

    def _scalar(self, key: str, allowed: set, what: str) -> Any:
        field = self._field(key)
        if len(field.types) != 1 or field.types[0] not in allowed:
            got = "/".join(t.name for t in field.types)
            raise MetadataError(f"{self.path}: metadata key {key!r} should be {what}, "
                                f"found {got}")
        return field.parts[-1][0]

    def get_int(self, key: str, default: int | None = None, *,
                positive: bool = False) -> int:
        """An integer key.  `positive=True` marks a structural count: zero is broken."""
        if default is not None and key not in self.fields:
            return default
        value = int(self._scalar(key, _INT_TYPES, "an integer"))
        if positive and value <= 0:
            raise MetadataError(
                f"{self.path}: metadata key {key!r} is {value}; it must be positive "
                "(a zero here can only be a broken file)")
        return value

    def get_float(self, key: str, default: float | None = None) -> float:
        if default is not None and key not in self.fields:
            return default
        return float(self._scalar(key, _FLOAT_TYPES, "a float"))

    def get_bool(self, key: str, default: bool | None = None) -> bool:
        if default is not None and key not in self.fields:
            return default
        return bool(self._scalar(key, {GGUFValueType.BOOL}, "a bool"))

    def get_str(self, key: str, default: str | None = None) -> str:
        if default is not None and key not in self.fields:
            return default
        field = self._field(key)
        if field.types != [GGUFValueType.STRING]:
            raise MetadataError(f"{self.path}: metadata key {key!r} should be a string")
        return bytes(field.parts[-1]).decode("utf-8", errors="replace")

    def get_array(self, key: str) -> np.ndarray:
        """A numeric array key as one numpy view (no per-element work)."""
        field = self._field(key)
        if (len(field.types) != 2 or field.types[0] != GGUFValueType.ARRAY
                or field.types[1] == GGUFValueType.STRING):
            raise MetadataError(f"{self.path}: metadata key {key!r} should be a "
                                "numeric array")
        return field.parts[field.data[0]]

    def array_length(self, key: str) -> int:
        """Elements of an array key, without reading them (to check before building)."""
        field = self._field(key)
        if field.types[:1] != [GGUFValueType.ARRAY]:
            raise MetadataError(f"{self.path}: metadata key {key!r} should be an array")
        return len(field.data)

    def _string_parts(self, key: str) -> "_LazyStringParts":
        """The offsets and lengths of a string-array key's strings in the mapping."""
        parts = self._field(key).parts
        if not isinstance(parts, _LazyStringParts):
            raise MetadataError(f"{self.path}: metadata key {key!r} should be an array "
                                "of strings")
        return parts

    def get_strings(self, key: str) -> list[bytes]:
        """A string-array key as a list of raw bytes, in one pass over the mapping."""
        parts = self._string_parts(key)
        if not len(parts.starts):
            return []
        base = int(parts.starts[0])
        blob = bytes(self._reader.data[base:int(parts.starts[-1] + parts.lengths[-1])])
        return [blob[s - base:s - base + n]
                for s, n in zip(parts.starts.tolist(), parts.lengths.tolist())]

    def string_array_bytes(self, key: str) -> memoryview:
        """A string-array key's bytes as stored (each string's 8-byte length, then the
        string), without making one object per string: what the tokenizer's disk
        cache hashes (tokenizer.py)."""
        parts = self._string_parts(key)
        if not len(parts.starts):
            return memoryview(b"")
        start = int(parts.starts[0]) - 8
        return memoryview(self._reader.data)[start:int(parts.starts[-1]
                                                       + parts.lengths[-1])]

    @property
    def architecture(self) -> str:
        return self.get_str("general.architecture")

    # --- tensors ----------------------------------------------------------------------

    def tensor(self, name: str) -> TensorInfo:
        t = self.tensors.get(name)
        if t is None:
            raise MetadataError(f"{self.path}: tensor {name!r} is missing")
        return t

    def format_summary(self) -> dict[str, tuple[int, int]]:
        """{block format name: (tensor count, bytes)} over all tensors, largest first.
        """
        out: dict[str, list[int]] = {}
        for t in self.tensors.values():
            entry = out.setdefault(t.type_name, [0, 0])
            entry[0] += 1
            entry[1] += t.n_bytes
        ranked = sorted(out.items(), key=lambda kv: -kv[1][1])
        return {k: (v[0], v[1]) for k, v in ranked}


def _check_path(path: Path) -> None:
    """The cheap checks, before anything is mapped: a file, the magic, a version.

    The version is checked here rather than by `GGUFReader`, because the reference
    reader would *accept* a byte-swapped (big-endian) file and parse it swapped; the
    engine's kernels read little-endian blocks, so such a file could only compute
    garbage.
    """
    if not path.exists():
        raise ModelFileError(f"{path}: no such file")
    if path.is_dir():
        raise ModelFileError(f"{path}: is a directory, not a GGUF file")
    try:
        with open(path, "rb") as f:
            head = f.read(24)
    except OSError as e:
        raise ModelFileError(f"{path}: cannot be read ({e.strerror})") from None
    if len(head) < 4 or head[:4] != GGUF_MAGIC:
        raise ModelFileError(f"{path}: not a GGUF file (it does not start with the "
                             "bytes 'GGUF')")
    if len(head) < 24:
        raise ModelFileError(f"{path}: truncated GGUF file (header incomplete)")
    (version,) = struct.unpack_from("<I", head, 4)
    if version & 0xFFFF == 0 and version:
        raise ModelFileError(f"{path}: big-endian GGUF file (version field "
                             f"{version:#x}); only little-endian files are supported")
    if version not in SUPPORTED_VERSIONS:
        known = " and ".join(map(str, SUPPORTED_VERSIONS))
        raise ModelFileError(f"{path}: GGUF version {version} is not supported "
                             f"(versions {known} are)")


def open_gguf(path: str | os.PathLike) -> GGUFFile:
    return GGUFFile(path)
