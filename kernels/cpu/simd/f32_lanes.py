"""Reductions over float32 rows, 16 lanes at a time, for the attention kernel's softmax.

Why: numba compiles `m = max(m, a[s])` to a scalar compare per element (LLVM does not vectorise
that float reduction here, fastmath or not): 7 us of a verify job's 44 (27 rows of 512 scores;
bench/history/2026-11-24-25-cpu-vs-llamacpp-avx2.md), more than the scores' exponentials. Here 16
lanes keep their own maxima, folded once at the end; a maximum is exact whatever the order, so the
result is the scalar loop's (NaN aside: a row holding one has no meaningful maximum either way)."""
from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from triforce.kernels.cpu.simd.bf16_dot import LANES, f32x16, splat, sum16, zeros

_WIDTH = 16


@intrinsic
def _load16(typingctx, a, start):
    """a[start:start + 16] as one vector (a 1-D contiguous float32 array)."""
    if not (isinstance(a, types.Array) and a.dtype == types.float32 and a.ndim == 1):
        return None

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        return builder.load(builder.bitcast(builder.gep(data, [args[1]]), LANES.as_pointer()), align=4)

    return f32x16(a, types.intp), codegen


@intrinsic
def _larger(typingctx, x, y):
    """Lane by lane, the larger of x and y."""
    if x != f32x16 or y != f32x16:
        return None

    def codegen(context, builder, signature, args):
        return builder.select(builder.fcmp_ordered(">", args[0], args[1]), args[0], args[1])

    return f32x16(x, y), codegen


@intrinsic
def _lane(typingctx, x, i):
    if x != f32x16:
        return None
    return types.float32(x, types.intp), lambda context, builder, signature, args: builder.extract_element(
        args[0], builder.trunc(args[1], ir.IntType(32)))


@numba.njit(cache=True)
def max_of(a, n):
    """The largest of a[:n] (n >= 1; a 1-D contiguous float32 array)."""
    full = n - n % _WIDTH
    top = a[0]
    if full:
        lanes = _load16(a, 0)
        for s in range(_WIDTH, full, _WIDTH):
            lanes = _larger(lanes, _load16(a, s))
        for i in range(_WIDTH):
            top = max(top, _lane(lanes, i))
    for s in range(full, n):
        top = max(top, a[s])
    return np.float32(top)


# exp as in triforce.kernels.cpu.simd.exp (Cephes' expf: Cody-Waite reduction, degree-6 polynomial),
# written for 16 lanes with multiply-adds that LLVM may fuse: numba's loops in exp_in_place ran
# it in 8-lane pieces with separate multiplies and adds, and a verify job's softmax (27 rows of
# 512 scores) spent ~4 us there.
_EXP_POLY = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1,
             5.0000001201e-1)


def _lanes(value: float):
    return ir.Constant(LANES, [value] * _WIDTH)


def _call(builder, name, *args):
    """LLVM's intrinsic `name` on 16 float32 lanes (llvm.floor, llvm.fmuladd)."""
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(LANES, [LANES] * len(args)), f"{name}.v16f32")
    return builder.call(fn, list(args))


def exp_below(builder, x, top):
    """exp(x - top) in each lane (x <= top), its argument clamped to >= -87 as exp_in_place's."""
    d = builder.fsub(x, splat(builder, top, LANES))
    floor = _lanes(-87.0)
    d = builder.select(builder.fcmp_ordered(">", d, floor), d, floor)
    k = _call(builder, "llvm.floor", builder.fadd(builder.fmul(d, _lanes(1.44269504)), _lanes(0.5)))
    f = _call(builder, "llvm.fmuladd", k, _lanes(-0.693359375), d)
    f = _call(builder, "llvm.fmuladd", k, _lanes(2.12194440e-4), f)
    p = _lanes(_EXP_POLY[0])
    for c in _EXP_POLY[1:]:
        p = _call(builder, "llvm.fmuladd", p, f, _lanes(c))
    y = builder.fadd(_call(builder, "llvm.fmuladd", p, builder.fmul(f, f), f), _lanes(1.0))
    ints = ir.VectorType(ir.IntType(32), _WIDTH)
    power = builder.shl(builder.add(builder.fptosi(k, ints), ir.Constant(ints, [127] * _WIDTH)),
                        ir.Constant(ints, [23] * _WIDTH))
    return builder.fmul(y, builder.bitcast(power, LANES))


@intrinsic
def _exp_step(typingctx, a, start, top, seen, total):
    """a[start:start + 16] = exp(a[...] - top) for the lanes before index `seen`, 0 after;
    returns total plus those 16 values."""
    if not (isinstance(a, types.Array) and a.dtype == types.float32 and a.ndim == 1) or total != f32x16:
        return None

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        where = builder.bitcast(builder.gep(data, [args[1]]), LANES.as_pointer())
        y = exp_below(builder, builder.load(where, align=4), args[2])
        ints = ir.VectorType(ir.IntType(64), _WIDTH)
        kept = builder.icmp_signed("<", ir.Constant(ints, list(range(_WIDTH))),
                                   splat(builder, builder.sub(args[3], args[1]), ints))  # lane i: start + i < seen
        y = builder.select(kept, y, _lanes(0.0))
        builder.store(y, where, align=4)
        return builder.fadd(args[4], y)

    return f32x16(a, types.intp, types.float32, types.intp, total), codegen


@numba.njit(cache=True)
def exp_sum(a, seen, top):
    """a[s] = exp(a[s] - top) for s < seen and 0 for seen <= s < len(a) (a multiple of 16);
    returns their sum, lane i of 16 summing a[i], a[i + 16], ... in order and the lanes then
    added in one fixed tree, so the sum does not depend on `seen` beyond the values it keeps."""
    total = zeros()
    for s in range(0, a.shape[0], _WIDTH):
        total = _exp_step(a, s, top, seen, total)
    return sum16(total)
