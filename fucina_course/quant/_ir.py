"""LLVM IR for the integer kernels: vector helpers, and builders turned into intrinsics.

numba compiles Python loops to LLVM IR, and LLVM does not turn them into the byte dot
products (`vpdpbusd`) that make ggml fast.  So the inner loop of each integer kernel is
written here directly in LLVM IR with llvmlite's builder, and exposed to numba as an
`@intrinsic` that a plain `@njit` kernel calls once per weight row:

* `row_intrinsic(builder)`: one weight row . one activation vector -> float32
  (the `mv_*` kernels of _vnni_matvec.py, used by `matvec`);
* `rows_intrinsic(builder)`: one weight row . a tile of up to TILE activation rows,
  stored into the output (the `mm_*` kernels of _vnni_matmul.py, used by `matmul`).

The vector helpers below name the LLVM intrinsics by their x86 instruction (LLVM 22 as
bundled with llvmlite 0.50 takes byte / word vector operands): `vpdpbusd` (4 adjacent
u8 x s8 products added to each int32 lane), `vpdpwssd` (2 s16 x s16), `vpmaddwd`,
`vpackssdw`, `llvm.fma`, `llvm.prefetch`.  The rest is generic IR (unaligned loads,
shifts, shuffles, selects) that LLVM lowers well.  No bounds checks: the builders stay
inside the row's blocks and the activation arrays their kernels size; a prefetch may
point past the end, which never faults.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

I8 = ir.IntType(8)
I16 = ir.IntType(16)
I32 = ir.IntType(32)
I64 = ir.IntType(64)
F32 = ir.FloatType()
F16 = ir.HalfType()

# activation rows per pass over a weight row (docs/BENCHMARKS.md#multi-row-kernels)
TILE = 8


def V(t, n):
    return ir.VectorType(t, n)


def i64(v):
    return ir.Constant(I64, v)


# --- vector helpers -------------------------------------------------------------------

def _fn(builder, name, ret, argtys):
    mod = builder.module
    fn = mod.globals.get(name)
    if fn is None:
        fn = ir.Function(mod, ir.FunctionType(ret, argtys), name=name)
    return fn


def call(builder, name, ret, *args):
    return builder.call(_fn(builder, name, ret, [a.type for a in args]), list(args))


def const_vec(t, n, values):
    if not isinstance(values, (list, tuple)):
        values = [values] * n
    return ir.Constant(V(t, n), list(values))


def load(builder, base, off, ty, align=1):
    """Load a `ty` from i8* `base` + i64 `off` (unaligned by default)."""
    p = builder.gep(base, [off]) if off is not None else base
    return builder.load(builder.bitcast(p, ty.as_pointer()), align=align)


def load_f16(builder, base, off):
    return builder.fpext(builder.bitcast(load(builder, base, off, I16), F16), F32)


def splat(builder, v, n):
    t = v.type
    u = ir.Constant(V(t, 1), ir.Undefined)
    u = builder.insert_element(u, v, ir.Constant(I32, 0))
    return builder.shuffle_vector(u, u, ir.Constant(V(I32, n), [0] * n))


def shuffle(builder, a, b, mask):
    return builder.shuffle_vector(a, b, ir.Constant(V(I32, len(mask)), list(mask)))


def prefetch(builder, base, off):
    i8p = I8.as_pointer()
    p = builder.bitcast(builder.gep(base, [off]), i8p)
    fn = _fn(builder, "llvm.prefetch.p0i8", ir.VoidType(), [i8p, I32, I32, I32])
    builder.call(fn, [p, ir.Constant(I32, 0), ir.Constant(I32, 3), ir.Constant(I32, 1)])


def dpbusd(builder, acc, u8, s8):
    """acc <n x i32> += sum of 4 adjacent u8 x s8 products per lane (vpdpbusd)."""
    n = acc.type.count
    return call(builder, f"llvm.x86.avx512.vpdpbusd.{32 * n}", acc.type, acc,
                builder.bitcast(u8, V(I8, 4 * n)), builder.bitcast(s8, V(I8, 4 * n)))


def dpwssd(builder, acc, a16, b16):
    """acc <n x i32> += sum of 2 adjacent s16 x s16 products per lane (vpdpwssd)."""
    n = acc.type.count
    a16 = builder.bitcast(a16, V(I16, 2 * n))
    b16 = builder.bitcast(b16, V(I16, 2 * n))
    return call(builder, f"llvm.x86.avx512.vpdpwssd.{32 * n}", acc.type, acc, a16, b16)


def pmaddwd(builder, a16, b16):
    n = a16.type.count // 2 if a16.type.element == I16 else a16.type.count
    name = "llvm.x86.avx2.pmadd.wd" if n == 8 else "llvm.x86.avx512.pmaddw.d.512"
    return call(builder, name, V(I32, n), builder.bitcast(a16, V(I16, 2 * n)),
                builder.bitcast(b16, V(I16, 2 * n)))


def packssdw(b, a, c):
    n = a.type.count
    name = "llvm.x86.avx512.packssdw.512" if n == 16 else "llvm.x86.avx2.packssdw"
    return call(b, name, V(I16, 2 * n), a, c)


def hsum_f32(builder, v):
    """Tree sum of a float vector (halving shuffles)."""
    n = v.type.count
    while n > 1:
        h = n // 2
        lo = shuffle(builder, v, v, list(range(h)))
        hi = shuffle(builder, v, v, list(range(h, n)))
        v = builder.fadd(lo, hi)
        n = h
    return builder.extract_element(v, ir.Constant(I32, 0))


def fold16(builder, v):
    """<16 x f32> -> <8 x f32>: the two halves added lane by lane."""
    lo = shuffle(builder, v, v, range(8))
    return builder.fadd(lo, shuffle(builder, v, v, range(8, 16)))


def fma(builder, a, b, c):
    n = a.type.count
    return call(builder, f"llvm.fma.v{n}f32", a.type, a, b, c)


def block_at(builder, w, i, bpb, pf, lines):
    """i8* to block i (of bpb bytes) of the weight row at w, after prefetching `lines`
    cache lines of the block pf bytes ahead."""
    o = builder.mul(i, i64(bpb))
    po = builder.add(o, pf)
    for k in range(lines):
        prefetch(builder, w, builder.add(po, i64(64 * k)))
    return builder.gep(w, [o])


def _c_array(t, ndim):
    return isinstance(t, types.Array) and t.ndim == ndim and t.layout == "C"


# --- one weight row . one activation vector -------------------------------------------

def row_intrinsic(body, *extra, **options):
    """A numba intrinsic f(wf, off, n, x8, xd, xs, pf) -> float32.

    `body(builder, w, x8, xd, xs, n, pf, *extra, **options)` builds the dot product of
    the weight row at byte `off` of wf (n blocks) with activations x8 (int8), their
    scales xd (float32) and the format's side array xs, prefetching pf bytes ahead.
    All arrays 1-D and C-contiguous."""
    @intrinsic
    def row_dot(typingctx, wf, off, n, x8, xd, xs, pf):
        if not all(_c_array(t, 1) for t in (wf, x8, xd, xs)):
            return None
        sig = types.float32(wf, off, n, x8, xd, xs, pf)

        def codegen(context, builder, signature, args):
            a = signature.args

            def ptr(k):
                ary = context.make_array(a[k])(context, builder, args[k])
                return builder.bitcast(ary.data, I8.as_pointer())

            def int64(k):
                return context.cast(builder, args[k], a[k], types.int64)

            w = builder.gep(ptr(0), [int64(1)])
            return body(builder, w, ptr(3), ptr(4), ptr(5), int64(2), int64(6),
                        *extra, **options)

        return sig, codegen
    return row_dot


# --- one weight row . a tile of activation rows ---------------------------------------

class Tile:
    """Activation rows t0 .. t0+nr of 2-D C arrays x8 [m, n] (int8), xd [m, nblk] (f32),
    xs [m, *] (the side array) and the output y [m, ldy] (f32, column `col`), as i8*
    pointers and byte strides."""

    def __init__(self, x, xst, xd, xdst, xs, xsst, y, yst, t0, nr, col):
        self.x, self.xst, self.xd, self.xdst = x, xst, xd, xdst
        self.xs, self.xsst = xs, xsst
        self.y, self.yst, self.t0, self.nr, self.col = y, yst, t0, nr, col

    def ptrs(self, b, r):
        """(x, xd, xs) i8* of tile row r (an i64 value)."""
        i = b.add(self.t0, r)
        return (b.gep(self.x, [b.mul(i, self.xst)]),
                b.gep(self.xd, [b.mul(i, self.xdst)]),
                b.gep(self.xs, [b.mul(i, self.xsst)]))

    def store(self, b, r, v):
        i = b.add(self.t0, r)
        off = b.add(b.mul(i, self.yst), b.mul(self.col, i64(4)))
        b.store(v, b.bitcast(b.gep(self.y, [off]), F32.as_pointer()))


class Rows:
    """The TILE rows of a tile in straight-line code, each behind a `k < nr` branch
    (row 0 always runs: nr >= 1), with per-row accumulators.  Only rows < nr are stored.
    Why unrolled and branch-guarded: docs/BENCHMARKS.md#multi-row-kernels."""

    def __init__(self, tile, n=TILE):
        self.tile, self.n = tile, n

    def each(self, b, fn):
        """fn(r, k): r the tile row (an i64 constant), k its index (an int)."""
        for k in range(self.n):
            kc = i64(k)
            if k == 0:
                fn(kc, k)
            else:
                with b.if_then(b.icmp_signed("<", kc, self.tile.nr), likely=True):
                    fn(kc, k)

    def acc(self, b, ty, memory=False):
        """Accumulator slots, acc(b, k) -> pointer: in registers (allocas that LLVM
        promotes), or, with memory=True, in an array read and written through `ld` /
        `st` as volatile (fewer registers for accumulators touched once per block)."""
        if not memory:
            slots = [cgutils.alloca_once(b, ty) for _ in range(self.n)]
            return lambda b, k: slots[k]
        arr = cgutils.alloca_once(b, ir.ArrayType(ty, self.n))
        zero = ir.Constant(I32, 0)
        return lambda b, k: _Slot(b.gep(arr, [zero, ir.Constant(I32, k)]))

    def finish(self, b, fn):
        """fn(r, k) -> f32 result of row r; stored for the rows < nr."""
        for k in range(self.n):
            kc = i64(k)
            v = fn(kc, k)
            with cgutils.if_likely(b, b.icmp_signed("<", kc, self.tile.nr)):
                self.tile.store(b, kc, v)


class _Slot:
    """An accumulator kept in memory on purpose: `ld` / `st` make its loads and stores
    volatile, so LLVM neither promotes it to a register nor drops the traffic."""

    def __init__(self, ptr):
        self.ptr = ptr


class _VolatileLoad(ir.instructions.LoadInstr):
    def descr(self, buf):
        [ptr] = self.operands
        buf.append(f"load volatile {self.type}, {ptr.type} {ptr.get_reference()}, "
                   f"align {self.align}\n")


class _VolatileStore(ir.instructions.StoreInstr):
    def descr(self, buf):
        val, ptr = self.operands
        buf.append(f"store volatile {val.type} {val.get_reference()}, {ptr.type} "
                   f"{ptr.get_reference()}, align {self.align}\n")


def ld(b, p):
    if not isinstance(p, _Slot):
        return b.load(p)
    ins = _VolatileLoad(b.block, p.ptr, typ=p.ptr.type.pointee)
    ins.align = 1
    b._insert(ins)
    return ins


def st(b, v, p):
    if not isinstance(p, _Slot):
        return b.store(v, p)
    ins = _VolatileStore(b.block, v, p.ptr)
    ins.align = 1
    b._insert(ins)
    return ins


def rows_intrinsic(body, *extra, **options):
    """A numba intrinsic f(addr, off, n, x8, xd, xs, t0, nr, y, col, pf) -> None.

    `body(builder, w, n, tile, pf, rows, *extra, **options)` builds the dot products of
    the weight row at address addr + off (n blocks) with activation rows t0 .. t0+nr
    (nr <= TILE) of x8 [m, n_in] int8, xd [m, *] f32 and the side array xs [m, *];
    the result of row t0 + i goes to y[t0 + i, col].  All arrays 2-D, C-contiguous.
    `addr` is the address of a weight matrix's bytes (an int64, so that one kernel call
    can cover several matrices: MultiMatrix)."""
    @intrinsic
    def rows_dot(typingctx, addr, off, n, x8, xd, xs, t0, nr, y, col, pf):
        if not all(_c_array(t, 2) for t in (x8, xd, xs, y)):
            return None
        sig = types.void(addr, off, n, x8, xd, xs, t0, nr, y, col, pf)

        def codegen(context, builder, signature, args):
            a = signature.args

            def int64(k):
                return context.cast(builder, args[k], a[k], types.int64)

            def ptr_stride(k):
                ary = context.make_array(a[k])(context, builder, args[k])
                stride = cgutils.unpack_tuple(builder, ary.strides, 2)[0]
                return builder.bitcast(ary.data, I8.as_pointer()), stride

            w = builder.gep(builder.inttoptr(int64(0), I8.as_pointer()), [int64(1)])
            tile = Tile(*ptr_stride(3), *ptr_stride(4), *ptr_stride(5), *ptr_stride(8),
                        int64(6), int64(7), int64(9))
            body(builder, w, int64(2), tile, int64(10), Rows(tile), *extra, **options)
            return context.get_dummy_value()

        return sig, codegen
    return rows_dot
