"""Five tiny LLVM intrinsics the kernels need and numba does not offer on the CPU.

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
