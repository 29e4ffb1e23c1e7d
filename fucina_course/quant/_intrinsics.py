"""Ten tiny LLVM intrinsics the kernels need and numba does not offer on the CPU.

* `f16_to_f32(bits)` / `f32_to_f16_bits(x)`: IEEE half <-> single conversion.  numba
  cannot take `float16` arrays in CPU kernels, so the kernels read a half as two bytes
  and convert it here.  The intrinsic emits LLVM's own `fpext half -> float` /
  `fptrunc float -> half` (round to nearest even, exactly like numpy's
  `astype(np.float16)` and like ggml's F16C path), which LLVM lowers to
  `vcvtph2ps`/`vcvtps2ph` (or the AVX512-FP16 scalar forms) and vectorizes inside loops.
* `u32_as_f32(bits)` / `f32_as_u32(x)`: reinterpret a uint32 as float32 and back
  (BF16 -> f32 is `u32_as_f32(u16 << 16)`; ops.expf builds 2^n from the bits).
* `prefetch(array_1d, index)`: `llvm.prefetch` of the cache line holding
  `array_1d[index]`.  The address may lie past the end of the array: a prefetch never
  faults.  Software prefetch lifts the matvec kernels from ~7.5 to ~16 GB/s on a
  model-sized sweep here (matvec.py).
* `block32_amax_bits(x, o)` / `block32_quantize(x, o, scale, q)`: the two steps of
  quantizing one 32-value block of activations (activations.py), written as one
  `<32 x float>` / `<32 x i32>` operation each: the largest |x| as an unsigned max
  over the bits (`llvm.vector.reduce.umax`), and `q = int8(min(rint(x * scale), 127))`
  with the sum of q (`llvm.rint`, `llvm.vector.reduce.add`).  Written as numba loops,
  LLVM unrolled the 32-long loops before it could vectorize them and turned the amax
  chain of `max` into branches (x86's cmov conversion), mispredicted on real data:
  256 x 1024 Q8_0 activations took 693-697 us, with these 91-117, bit for bit the
  same (one slow hour, docs/BENCHMARKS.md).
* `block16_max(x, o, top)`: max(top, x[o:o+16]) as one `<16 x float>` reduction
  (`llvm.vector.reduce.fmax`, then `llvm.maxnum`; a NaN is skipped, as maxnum does).
  The softmax's row maximum (attention.py): numba's `max` in a loop is a chain of
  scalar maxima, one after the other, which no flag let LLVM vectorize.

* `lanes32_dot_f16(x, w, n)` / `lanes32_sum_f64(x, n)`: a dot product of float32 x
  and half w, and a float64 sum of float32 x, over 32 n values in one order whatever
  the SIMD width: a `<32 x float>` (`<32 x double>`) accumulator, lane l adding values
  l, l + 32, ... in order, then a fixed tree (`tree_sum32`); plain fmul / fadd, no
  fast-math flags, so LLVM splits the vectors into its registers but reorders nothing.
  attention.py's decode kernel: written as numba loops the sums needed `reassoc` to
  vectorize, and then LLVM picked its partial sums per vector width (x86 and aarch64
  differed); a numba 32-float accumulator without `reassoc` stayed in memory and ran
  the kernel 2.2x slower; these run it as fast as `reassoc` did (x86).

`tests/test_quant.py` checks the two conversions exhaustively (all 65,536 halves)
against numpy.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

_I16 = ir.IntType(16)
_I32 = ir.IntType(32)
_I8P = ir.IntType(8).as_pointer()
_F32 = ir.FloatType()
_V32I = ir.VectorType(_I32, 32)
_V32F = ir.VectorType(_F32, 32)
_V32B = ir.VectorType(ir.IntType(8), 32)
_V16F = ir.VectorType(_F32, 16)


@intrinsic
def f16_to_f32(typingctx, bits):
    """float32 value of the IEEE half held in the low 16 bits of the integer `bits`."""
    if not isinstance(bits, types.Integer):
        return None
    sig = types.float32(bits)

    def codegen(context, builder, signature, args):
        (v,) = args
        width = v.type.width
        if width > 16:
            v = builder.trunc(v, _I16)
        elif width < 16:
            v = builder.zext(v, _I16)
        return builder.fpext(builder.bitcast(v, ir.HalfType()), ir.FloatType())

    return sig, codegen


@intrinsic
def f32_to_f16_bits(typingctx, x):
    """Bits (uint16) of float32 `x` rounded to the nearest IEEE half (ties to even)."""
    if x != types.float32:
        return None
    sig = types.uint16(types.float32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), _I16)

    return sig, codegen


@intrinsic
def prefetch(typingctx, arr, idx):
    """Hint the CPU to pull the cache line of `arr[idx]` into L1 (read, keep)."""
    if not (isinstance(arr, types.Array) and arr.ndim == 1
            and isinstance(idx, types.Integer)):
        return None
    sig = types.void(arr, idx)

    def codegen(context, builder, signature, args):
        ary = context.make_array(signature.args[0])(context, builder, args[0])
        ptr = builder.bitcast(builder.gep(ary.data, [args[1]]), _I8P)
        fnty = ir.FunctionType(ir.VoidType(), [_I8P, _I32, _I32, _I32])
        mod = builder.module
        name = "llvm.prefetch.p0i8"
        fn = mod.globals.get(name)
        if fn is None:
            fn = ir.Function(mod, fnty, name=name)
        # rw = 0 (read), locality = 3 (keep in all levels), cache type = 1 (data)
        builder.call(fn, [ptr, ir.Constant(_I32, 0), ir.Constant(_I32, 3),
                          ir.Constant(_I32, 1)])
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def u32_as_f32(typingctx, bits):
    """Reinterpret the low 32 bits of the integer `bits` as a float32 (BF16:
    `bits = u16 << 16`)."""
    if not isinstance(bits, types.Integer):
        return None
    sig = types.float32(bits)

    def codegen(context, builder, signature, args):
        (v,) = args
        if v.type.width > 32:
            v = builder.trunc(v, _I32)
        elif v.type.width < 32:
            v = builder.zext(v, _I32)
        return builder.bitcast(v, ir.FloatType())

    return sig, codegen


@intrinsic
def f32_as_u32(typingctx, x):
    """The 32 bits of float32 `x` as a uint32 (no conversion)."""
    if x != types.float32:
        return None
    sig = types.uint32(types.float32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], _I32)

    return sig, codegen


def _llvm_function(builder, name: str, ret, args):
    fn = builder.module.globals.get(name)
    if fn is None:
        fn = ir.Function(builder.module, ir.FunctionType(ret, args), name=name)
    return fn


def _block(context, builder, aty, arr, idx, vty):
    """A `vty *` to element `idx` of the 1-D array `arr`."""
    ary = context.make_array(aty)(context, builder, arr)
    return builder.bitcast(builder.gep(ary.data, [idx]), vty.as_pointer())


@intrinsic
def block32_amax_bits(typingctx, x, o):
    """The largest of x[o:o+32]'s bit patterns with the sign bit cleared (uint32): the
    bits of max |x| for finite x (the order of non-negative floats is their bits'),
    and >= 0x7F800000 if the block holds an infinity or a NaN."""
    if not (isinstance(x, types.Array) and x.ndim == 1 and x.dtype == types.float32
            and isinstance(o, types.Integer)):
        return None
    sig = types.uint32(x, o)

    def codegen(context, builder, signature, args):
        p = _block(context, builder, signature.args[0], args[0], args[1], _V32I)
        v = builder.and_(builder.load(p, align=4), ir.Constant(_V32I, [0x7FFFFFFF] * 32))
        fn = _llvm_function(builder, "llvm.vector.reduce.umax.v32i32", _I32, [_V32I])
        return builder.call(fn, [v])

    return sig, codegen


@intrinsic
def block32_quantize(typingctx, x, o, scale, q):
    """q[o:o+32] = int8(min(rint(x[o:o+32] * scale), 127)) (round half to even);
    returns the sum of the 32 quants (int32).  x float32, q int8, both 1-D."""
    if not (isinstance(x, types.Array) and x.ndim == 1 and x.dtype == types.float32
            and isinstance(q, types.Array) and q.ndim == 1 and q.dtype == types.int8
            and isinstance(o, types.Integer) and scale == types.float32):
        return None
    sig = types.int32(x, o, scale, q)

    def codegen(context, builder, signature, args):
        a = signature.args
        px = _block(context, builder, a[0], args[0], args[1], _V32F)
        pq = _block(context, builder, a[3], args[3], args[1], _V32B)
        s = builder.insert_element(ir.Constant(_V32F, None), args[2], ir.Constant(_I32, 0))
        s = builder.shuffle_vector(s, ir.Constant(_V32F, None),
                                   ir.Constant(_V32I, [0] * 32))
        rint = _llvm_function(builder, "llvm.rint.v32f32", _V32F, [_V32F])
        r = builder.call(rint, [builder.fmul(builder.load(px, align=4), s)])
        top = ir.Constant(_V32F, [127.0] * 32)
        r = builder.select(builder.fcmp_ordered(">", r, top), top, r)
        qi = builder.fptosi(r, _V32I)
        builder.store(builder.trunc(qi, _V32B), pq, align=1)
        add = _llvm_function(builder, "llvm.vector.reduce.add.v32i32", _I32, [_V32I])
        return builder.call(add, [qi])

    return sig, codegen


@intrinsic
def block16_max(typingctx, x, o, top):
    """The largest of `top` and x[o:o+16] (float32; NaNs skipped, as llvm.maxnum)."""
    if not (isinstance(x, types.Array) and x.ndim == 1 and x.dtype == types.float32
            and isinstance(o, types.Integer) and top == types.float32):
        return None
    sig = types.float32(x, o, top)

    def codegen(context, builder, signature, args):
        p = _block(context, builder, signature.args[0], args[0], args[1], _V16F)
        fmax = _llvm_function(builder, "llvm.vector.reduce.fmax.v16f32", _F32, [_V16F])
        maxnum = _llvm_function(builder, "llvm.maxnum.f32", _F32, [_F32, _F32])
        block = builder.call(fmax, [builder.load(p, align=4)])
        return builder.call(maxnum, [args[2], block])

    return sig, codegen


_V32H = ir.VectorType(ir.HalfType(), 32)
_V32S = ir.VectorType(_I16, 32)
_V32D = ir.VectorType(ir.DoubleType(), 32)


def _halves(builder, v, n: int):
    """(v[:n], v[n:2n]) of a 2n-lane vector."""
    undef = ir.Constant(v.type, ir.Undefined)
    lo = builder.shuffle_vector(v, undef, ir.Constant(ir.VectorType(_I32, n),
                                                      list(range(n))))
    hi = builder.shuffle_vector(v, undef, ir.Constant(ir.VectorType(_I32, n),
                                                      list(range(n, 2 * n))))
    return lo, hi


def tree_sum32(builder, v):
    """The float lanes of `<32 x float>` v summed in one fixed order: halves added
    lane-wise (32 -> 16 -> 8 -> 4 -> 2), then lane 0 + lane 1; plain `fadd`s, so LLVM
    may not reorder them on any target (the order AVX-512 reduces two zmm in)."""
    for n in (16, 8, 4, 2):
        lo, hi = _halves(builder, v, n)
        v = builder.fadd(lo, hi)
    return builder.fadd(builder.extract_element(v, ir.Constant(_I32, 0)),
                        builder.extract_element(v, ir.Constant(_I32, 1)))


def _lanes32(context, builder, sig, args, body, zero):
    """Accumulate body(i) (a 32-lane vector for block i) over blocks 0..n-1 lane-wise,
    in order, then `tree_sum32`: the lane accumulator lives in registers."""
    from numba.core import cgutils
    n = args[-1]
    acc = cgutils.alloca_once_value(builder, zero)
    with cgutils.for_range(builder, n) as loop:
        builder.store(builder.fadd(builder.load(acc), body(loop.index)), acc)
    return tree_sum32(builder, builder.load(acc))


@intrinsic
def lanes32_dot_f16(typingctx, x, w, n):
    """sum_j x[j] * half(w[j]), j < 32 n: x float32, w uint16 (IEEE half bits), 1-D and
    contiguous.  Lane l adds the products l, l + 32, ... in order (float32 `fmul` and
    `fadd`: no FMA), then `tree_sum32`."""
    if not (isinstance(x, types.Array) and x.ndim == 1 and x.dtype == types.float32
            and isinstance(w, types.Array) and w.ndim == 1 and w.dtype == types.uint16
            and x.layout == "C" and w.layout == "C" and isinstance(n, types.Integer)):
        return None
    sig = types.float32(x, w, n)

    def codegen(context, builder, signature, args):
        xa = context.make_array(signature.args[0])(context, builder, args[0])
        wa = context.make_array(signature.args[1])(context, builder, args[1])

        def body(i):
            o = builder.mul(i, ir.Constant(i.type, 32))
            px = builder.bitcast(builder.gep(xa.data, [o]), _V32F.as_pointer())
            pw = builder.bitcast(builder.gep(wa.data, [o]), _V32S.as_pointer())
            wf = builder.fpext(builder.bitcast(builder.load(pw, align=2), _V32H), _V32F)
            return builder.fmul(builder.load(px, align=4), wf)

        return _lanes32(context, builder, signature, args, body,
                        ir.Constant(_V32F, [0.0] * 32))

    return sig, codegen


@intrinsic
def lanes32_sum_f64(typingctx, x, n):
    """sum_j x[j], j < 32 n, in float64: x float32, 1-D, contiguous.  Lane l adds the
    values l, l + 32, ... in order, then `tree_sum32` (in float64)."""
    if not (isinstance(x, types.Array) and x.ndim == 1 and x.dtype == types.float32
            and x.layout == "C" and isinstance(n, types.Integer)):
        return None
    sig = types.float64(x, n)

    def codegen(context, builder, signature, args):
        xa = context.make_array(signature.args[0])(context, builder, args[0])

        def body(i):
            o = builder.mul(i, ir.Constant(i.type, 32))
            px = builder.bitcast(builder.gep(xa.data, [o]), _V32F.as_pointer())
            return builder.fpext(builder.load(px, align=4), _V32D)

        return _lanes32(context, builder, signature, args, body,
                        ir.Constant(_V32D, [0.0] * 32))

    return sig, codegen
