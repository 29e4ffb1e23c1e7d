"""The integer kernels of one (format, level): built, compiled lazily, run in parallel.

`IntKernels(format, level)` is one entry of the dispatch tables (matvec.KERNELS,
matmul.KERNELS).  Nothing is compiled when it is created: `load()` builds the format's
LLVM module for the level (the row builder of _int_matvec.py, the tile builder of
_int_matmul.py and the activation preps they need), compiles or loads it (_jit.py) and
keeps the function addresses.  One numba kernel runs them all, `run`: every quantized
format, at every level, for matvec and matmul, so a first start compiles one numba
kernel however many formats a file holds (cached on disk like every numba kernel).

`run` prepares the activations once per call (a matmul's rows in parallel: a 256-row
Q4_K prep, the nibble-ordered copy, had cost ~7% of the matmul serially, 3 of 3 A/B
runs), then `prange`s over chunks of ROWS weight rows and calls the level's function
for each chunk.  In decode it first quantizes the float activation vector itself,
through the quantizer's address (fns[QUANTIZER], activations.row_quantizer).  It
takes all parts of a MultiMatrix (q/k/v, gate/up) in one call: one parallel region
and one activation pass instead of three.
"""

from __future__ import annotations

import os

import numpy as np
from gguf import GGMLQuantizationType as T
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from . import _jit, isa
from ._int_matmul import tile_spec
from ._int_packed import define_packed, has_packed, prep_packed
from . import _int_smmla  # noqa: F401  (registers the i8mm layout with _int_packed)
from ._int_matvec import (PREFETCH, ROWS, blk32_row, prep_function, row_function,
                          row_spec)
from ._ir import I8P, I64, define_matmul, define_matvec, define_prep
from .activations import NON_FINITE, NonFiniteActivations, row_quantizer
from .formats import FORMATS

# The slots of `fns`, the function addresses `run` calls (`IntKernels.load()`).  An
# int64 array read at these constant indices, not a record or a tuple: numba compiles
# `fns[MATVEC]` to the same load as `fns[1]`, and `run` keeps its one signature (a
# record type would be a new one, compiled on every first start).
PREP_MV = 0        # matvec's activation prep (define_prep; 0: none)
MATVEC = 1         # matvec: weight rows . one activation row (define_matvec)
PREP_MM = 2        # matmul's prep of each activation row (0: none, or no tiles)
MATMUL = 3         # matmul: weight rows . tiles of activation rows (0: no tiles)
QUANTIZER = 4      # decode's activation quantizer (activations.row_quantizer) ...
QUANT_CODE = 5     # ... and its code: 0 Q8_0, 1 Q8_1, 2 Q8_K
PREP_PK = 6        # the packed GEMM's prep of each activation row (0: none) ...
PACKED = 7         # ... and the packed GEMM (_int_packed.py; 0: none)
N_SLOTS = 8
# the LLVM functions of `IntKernels.symbols()`, in its order
_LLVM_SLOTS = ((PREP_MV, "prep_mv"), (MATVEC, "matvec"), (PREP_MM, "prep_mm"),
               (MATMUL, "matmul"), (PREP_PK, "prep_pk"), (PACKED, "packed"))


class IntKernels:
    """The matvec and matmul kernels of one format at one integer level."""

    def __init__(self, ggml_type, level):
        self.ggml_type, self.level = ggml_type, level
        self.name = ggml_type.name.lower()
        # int64[N_SLOTS]: the addresses `run` calls, by the slots above (`load`)
        self.fns = None
        self._llvm = None               # the LLVM slots alone (`compile`)
        # True if the activations' side array is not d itself (Q8_1's s, Q8_K's bsum32)
        self.own_side = FORMATS[ggml_type].vec_dot_type != T.Q8_0

    def __repr__(self) -> str:
        return f"IntKernels({self.ggml_type.name}, {self.level})"

    @property
    def has_tiles(self) -> bool:
        """False at the generic level: its IR kernels are matvec only (matmul's "rows"
        path runs them row by row; the tile builders use x86 or aarch64 intrinsics)."""
        return self.level != isa.GENERIC

    @property
    def has_packed(self) -> bool:
        """True where the packed GEMM exists (_int_packed.py: the integer formats,
        at generic where its IR kernels are)."""
        return has_packed(self.ggml_type, self.level)

    def _slots(self) -> tuple[tuple[int, str], ...]:
        """(slot, part) of each LLVM function: matvec's two, matmul's with tiles, and
        the packed GEMM's two where it exists."""
        slots = _LLVM_SLOTS[:2]
        if self.has_tiles:
            slots += _LLVM_SLOTS[2:4]
        return slots + (_LLVM_SLOTS[4:] if self.has_packed else ())

    def _tile_prep(self):
        """The tiles' prep body, or None (none, or no tiles)."""
        if not self.has_tiles:
            return None
        return tile_spec(self.ggml_type, self.level).prep

    def symbols(self) -> list[str]:
        """The LLVM names of the functions `build` defines, in slot order."""
        return [f"{self.name}_{self.level}_{part}" for _, part in self._slots()]

    def build(self, mod: ir.Module) -> None:
        """Define the functions of `symbols()` in `mod` (a prep may be empty)."""
        t, lv = self.ggml_type, self.level
        bpb = FORMATS[t].block_bytes
        names = dict(zip((part for _, part in self._slots()), self.symbols()))
        define_prep(mod, names["prep_mv"], prep_function(t, lv) or _no_prep)
        define_matvec(mod, names["matvec"], row_function(t, lv), bpb, PREFETCH)
        if "matmul" in names:
            tile = tile_spec(t, lv)
            define_prep(mod, names["prep_mm"], tile.prep or _no_prep)
            define_matmul(mod, names["matmul"], tile.body, bpb, PREFETCH, tile.side)
        if self.has_packed:
            prep = prep_packed(t, lv, self._tile_prep(), mod.triple)
            define_prep(mod, names["prep_pk"], prep or _no_prep)
            fallback = mod.globals[names["matmul"]] if "matmul" in names else None
            define_packed(mod, names["packed"], t, lv, fallback)

    @property
    def cached(self) -> bool:
        """True if loading needs no compilation (in memory or in the disk cache)."""
        return self._llvm is not None or _jit.is_cached(self.name, self.level)

    def compile(self) -> np.ndarray:
        """The LLVM functions' addresses in their slots (0 for an empty prep; the
        others 0 until `load`), compiled or loaded on first use.  No numba
        compilation: quant.prepare runs this in a worker thread while numba compiles
        in the calling one (numba has one compiler lock)."""
        if self._llvm is None:
            addr = _jit.load(self.name, self.level, self.build, self.symbols())
            fns = np.zeros(N_SLOTS, np.int64)  # no tiles: run() is never given row < 0
            for (slot, _), symbol in zip(self._slots(), self.symbols()):
                fns[slot] = addr[symbol]
            t, lv = self.ggml_type, self.level
            if prep_function(t, lv) is None:
                fns[PREP_MV] = 0
            if self._tile_prep() is None:
                fns[PREP_MM] = 0
            if not self.has_packed or prep_packed(t, lv, self._tile_prep()) is None:
                fns[PREP_PK] = 0
            self._llvm = fns
        return self._llvm

    def load(self) -> np.ndarray:
        """All of fns: `compile()`'s, and the activation quantizer of the format's
        vec_dot_type with its code (fns[QUANTIZER], fns[QUANT_CODE]:
        activations.row_quantizer)."""
        if self.fns is None:
            fns = self.compile().copy()
            address, code = row_quantizer(FORMATS[self.ggml_type].vec_dot_type)
            fns[QUANTIZER], fns[QUANT_CODE] = address, code
            self.fns = fns
        return self.fns

    def describe(self) -> str:
        """What the kernels do, in a few words (`fucina info --kernels`)."""
        t, lv = self.ggml_type, self.level
        if lv == "generic":
            return "int16 activations, pmaddwd (SSE2; portable IR off x86)"
        if isa.is_arm(lv):
            ops = {"neon": "smull + pairwise adds (sdot's lanes)", "dotprod": "sdot",
                   "i8mm": "sdot (packed GEMM: smmla)"}[lv]
            return f"NEON {ops}" + (" + int16 pairs" if t.name[-1] == "K" else "")
        builder, opts, _ = row_spec(t, lv)
        wide = opts.get("width") == 512 or (builder is blk32_row and lv == "avx512vnni")
        kquant = builder is not blk32_row
        if lv == "avx2":
            ops = "vpmaddubsw + vpmaddwd"
            if t.name == "Q8_0":
                ops += " (sign trick)"
        else:
            ops = ("{vex} " if lv == "avxvnni" else "") + "vpdpbusd"
            ops += " + vpdpwssd" if kquant else ""
        return f"{'zmm' if wide else 'ymm'} {ops}"


def _no_prep(b, x, n, s):
    pass


# --- calling the functions from numba -------------------------------------------------

def _data(context, builder, ty, val):
    ary = context.make_array(ty)(context, builder, val)
    return builder.bitcast(ary.data, I8P)


def _stride0(context, builder, ty, val):
    ary = context.make_array(ty)(context, builder, val)
    return cgutils.unpack_tuple(builder, ary.strides, ty.ndim)[0]


def _call(builder, fn_addr, args):
    fnty = ir.FunctionType(ir.VoidType(), [a.type for a in args])
    builder.call(builder.inttoptr(fn_addr, fnty.as_pointer()), args)


@intrinsic
def _call_prep(typingctx, fn, x, s):
    """fn(x, n, s): a define_prep function on one activation row."""
    sig = types.void(fn, x, s)

    def codegen(context, builder, signature, args):
        a = signature.args
        n = context.make_array(a[1])(context, builder, args[1]).nitems
        _call(builder, args[0], [_data(context, builder, a[1], args[1]), n,
                                 _data(context, builder, a[2], args[2])])
        return context.get_dummy_value()
    return sig, codegen


def _as_array(context, builder, ty, val, dtype):
    """The C-contiguous 2-D array `val` (of type ty, bytes) as an array of `dtype` over
    the same memory, rows unchanged: (rows, bytes) -> (rows, bytes / itemsize)."""
    dst_ty = types.Array(dtype, 2, "C")
    src = context.make_array(ty)(context, builder, val)
    dst = context.make_array(dst_ty)(context, builder)
    size = ir.Constant(I64, context.get_abi_sizeof(context.get_data_type(dtype)))
    rows, nbytes = cgutils.unpack_tuple(builder, src.shape, 2)
    cols = builder.udiv(nbytes, size)
    dst.meminfo, dst.parent = src.meminfo, src.parent
    dst.nitems = builder.mul(rows, cols)
    dst.itemsize = size
    dst.shape = cgutils.pack_array(builder, [rows, cols])
    dst.strides = cgutils.pack_array(builder, [nbytes, size])
    dst.data = builder.bitcast(src.data, dst.data.type)
    return dst_ty, dst._getvalue()


@intrinsic
def _quantize(typingctx, fn, code, x, qi, d, side):
    """The activation quantizer at address fn (activations.row_quantizer, `code` 0
    Q8_0, 1 Q8_1, 2 Q8_K) on x f32[m, n], into qi, d and side, the latter given as the
    bytes `run` takes (Q8_1's s and Q8_K's bsum32 as float32 / int32, Q8_0's d again,
    which the quantizer leaves alone): 0, or 1 for non-finite x."""
    sig = types.int64(fn, code, x, qi, d, side)

    def codegen(context, builder, signature, args):
        a = signature.args
        ret = context.get_value_type(types.int64)
        status = cgutils.alloca_once(builder, ret)
        kind = context.cast(builder, args[1], a[1], types.int64)
        is_k = builder.icmp_signed("==", kind, ir.Constant(I64, 2))
        with builder.if_else(is_k) as (then, otherwise):
            for branch, dtype in ((then, types.int32), (otherwise, types.float32)):
                with branch:
                    side_ty, side = _as_array(context, builder, a[5], args[5], dtype)
                    tys, vals = [a[2], a[3], a[4], side_ty], [*args[2:5], side]
                    if dtype is types.float32:          # Q8_0 family: with_sum
                        tys.append(types.boolean)
                        vals.append(builder.icmp_signed("==", kind, ir.Constant(I64, 1)))
                    fnty = ir.FunctionType(ret, [context.get_value_type(t) for t in tys])
                    fp = builder.inttoptr(args[0], fnty.as_pointer())
                    builder.store(builder.call(fp, vals), status)
        return builder.load(status)
    return sig, codegen


@intrinsic
def _call_matvec(typingctx, fn, addr, r0, r1, col, rb, x, xd, xs, s, y):
    """fn(w, r0, r1, col, rb, x, xd, xs, s, y): a define_matvec function."""
    sig = types.void(fn, addr, r0, r1, col, rb, x, xd, xs, s, y)

    def codegen(context, builder, signature, args):
        a = signature.args

        def i64(k):
            return context.cast(builder, args[k], a[k], types.int64)

        ptrs = [_data(context, builder, a[k], args[k]) for k in range(6, 11)]
        w = builder.inttoptr(i64(1), I8P)
        _call(builder, args[0], [w, i64(2), i64(3), i64(4), i64(5)] + ptrs)
        return context.get_dummy_value()
    return sig, codegen


@intrinsic
def _call_matmul(typingctx, fn, addr, r0, r1, col, rb, x, xd, xs, s, y, ldy):
    """fn(w, r0, r1, col, rb, m, x, xst, xd, xdst, xs, xsst, s, sst, y, yst)."""
    sig = types.void(fn, addr, r0, r1, col, rb, x, xd, xs, s, y, ldy)

    def codegen(context, builder, signature, args):
        a = signature.args

        def i64(k):
            return context.cast(builder, args[k], a[k], types.int64)

        w = builder.inttoptr(i64(1), I8P)
        m = cgutils.unpack_tuple(
            builder, context.make_array(a[6])(context, builder, args[6]).shape, 2)[0]
        rest = []
        for k in range(6, 10):
            rest += [_data(context, builder, a[k], args[k]),
                     _stride0(context, builder, a[k], args[k])]
        rest += [_data(context, builder, a[10], args[10]),
                 builder.mul(i64(11), ir.Constant(I64, 4))]
        _call(builder, args[0], [w, i64(2), i64(3), i64(4), i64(5), m] + rest)
        return context.get_dummy_value()
    return sig, codegen


@njit(inline="always")
def _chunks(parts):
    """(part, first row) of every chunk of ROWS weight rows, over all parts."""
    nch = 0
    for p in range(parts.shape[0]):
        nch += (parts[p, 1] + ROWS - 1) // ROWS
    cp = np.empty(nch, np.int64)
    cr = np.empty(nch, np.int64)
    c = 0
    for p in range(parts.shape[0]):
        for r0 in range(0, parts[p, 1], ROWS):
            cp[c] = p
            cr[c] = r0
            c += 1
    return cp, cr


# `run`'s xf when the activations come quantized (one signature, so one compile)
NO_FLOATS = np.empty((0, 0), np.float32)


@njit(parallel=True, cache=True)
def run(fns, parts, rb, x, xd, xs, row, y, ldy, xf):
    """The weight matrices `parts` times activations, with the functions fns (an
    `IntKernels.load()`).

    parts int64[P, 3] = (address of the weight bytes, rows, first output column) of
    each matrix of a MultiMatrix (P = 1 for a QuantMatrix), all of one format and row
    length (rb bytes).  x int8[m, n_in] the quantized activations, xd f32 their block
    scales, xs their side array as bytes (`QuantizedActivations.side_bytes`).
    row >= 0: matvec of activation row `row`, y f32[n_out];
    row < 0: matmul of all m rows, y f32[m * ldy] (an [m, ldy] array, flattened):
    -1 by the tiles (fns[MATMUL]), -2 by the packed GEMM (fns[PACKED]).
    xf f32[1, n_in] (decode; else [0, 0]): the activations still as floats, quantized
    here by fns[QUANTIZER] into x, xd, xs (the caller's scratch, row 0): one call from
    Python per matvec instead of two (activations.row_quantizer).  The caller
    allocates them: each new `np.empty` signature in `run` cost its compile ~0.4 s."""
    if (xf.shape[0] == 1
            and _quantize(fns[QUANTIZER], fns[QUANT_CODE], xf, x, xd, xs) != 0):
        raise NonFiniteActivations(NON_FINITE)
    m, n = x.shape
    one = row >= 0
    packed = row == -2
    prep = fns[PREP_MV] if one else fns[PREP_PK] if packed else fns[PREP_MM]
    matmul = fns[PACKED] if packed else fns[MATMUL]
    nr = 1 if one else m
    # a prep writes n bytes (tiles, lane offsets, Q4_K's nibble order) or the generic
    # level's int16 activations (2n bytes: _int_matvec.prep_x16); the packed path's
    # adds its per-row data (n / 4 bytes at most) after them (_int_packed.prep_packed)
    s = np.empty((nr, (2 * n + n // 4 if packed else 2 * n) if prep != 0 else 0),
                 np.uint8)
    if prep != 0 and one:             # decode: no second parallel region per matvec
        _call_prep(prep, x[row], s[0])
    elif prep != 0:
        for t in prange(nr):
            _call_prep(prep, x[t], s[t])
    cp, cr = _chunks(parts)
    for c in prange(cp.size):
        p = cp[c]
        r1 = min(parts[p, 1], cr[c] + ROWS)
        if one:
            _call_matvec(fns[MATVEC], parts[p, 0], cr[c], r1, parts[p, 2], rb, x[row],
                         xd[row], xs[row], s[0], y)
        else:
            _call_matmul(matmul, parts[p, 0], cr[c], r1, parts[p, 2], rb, x, xd, xs,
                         s, y, ldy)


# --- the first start ------------------------------------------------------------------

def numba_cached(dispatcher) -> bool:
    """True if numba's disk cache holds an index for `dispatcher` (assumed True where
    numba's internals differ from 0.68's)."""
    try:
        return os.path.exists(dispatcher._cache._cache_file._index_path)
    except AttributeError:
        return True


def compile_driver() -> None:
    """Compile (or load from numba's cache) `run` for the one signature it has."""
    a2 = types.Array
    run.compile((a2(types.int64, 1, "C"), a2(types.int64, 2, "C"), types.int64,
                 a2(types.int8, 2, "C"), a2(types.float32, 2, "C"),
                 a2(types.uint8, 2, "C"), types.int64, a2(types.float32, 1, "C"),
                 types.int64, a2(types.float32, 2, "C")))
