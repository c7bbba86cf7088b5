"""The attention kernel's scores and weighted values for float32 on CPUs with FMA (AVX2), on the
explicit vectors of triforce.kernels.cpu.simd.f32_dot.

Why: with the sums left to LLVM's vectoriser, a verify job (27 query rows by 512 keys, head dim
64) took 96 us for its scores and 65 for its values on a 2-core Zen 3, ~20 GFLOP/s: each score
summed its lanes alone, and the values re-read and re-wrote each row's accumulator for every
four keys. Here a query row is read once for four keys (the f32_dot steps, eight chains), and a
row keeps 64 dimensions of its weighted values in registers for a block of keys.

Batch-invariant as the rest of the kernel: a score is `f32_dot.dot(q, k)` whatever the group it
is computed in, and a row's weighted values are one chain of fused multiply-adds over its keys in
order (keys it may not see weigh an exact 0 and leave the sums as they are), whatever the other
rows, so a verify pass computes each token as decoding it alone would."""
from __future__ import annotations

import numba
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from triforce.kernels.cpu.simd.bf16_dot import splat
from triforce.kernels.cpu.simd.prefetch import ask_rows
from triforce.kernels.cpu.simd.f32_dot import (LANES8, STEP, dot, dot4, f32x8, fma_instruction, is_f32_row, is_row, load8,
                                     vector_pointer)

VALUE_DIMS = 64  # dimensions a row keeps in registers (8 vectors): head dims must be a multiple
_VECTORS = VALUE_DIMS // 8
AHEAD = 32
KEY_BLOCK = 64   # keys per block of the values: 16 KB of values at head dim 64, read from L1 by every row


def fits(dim: int) -> bool:
    """Whether these kernels take a head dim."""
    return dim % STEP == 0 and dim % VALUE_DIMS == 0


@numba.njit(cache=True)
def scores_f32_fma(q, k, n, out):
    """out[r, s] = q[r] . k[s] for s < n (float32; q already scaled): four keys at a time, every
    row right after they are read (a job's keys stream from memory once, evenly)."""
    rows, dim = q.shape
    s = 0
    while s + 4 <= n:
        k0, k1, k2, k3 = k[s], k[s + 1], k[s + 2], k[s + 3]
        if s + AHEAD + 4 <= n:
            ask_rows(k, s + AHEAD, 4)
        for r in range(rows):
            out[r, s], out[r, s + 1], out[r, s + 2], out[r, s + 3] = dot4(q[r], k0, k1, k2, k3, dim)
        s += 4
    while s < n:
        for r in range(rows):
            out[r, s] = dot(q[r], k[s], dim)
        s += 1


def _vector(builder, base, i):
    return builder.gep(base, [ir.Constant(ir.IntType(64), i)])


@intrinsic
def _get(typingctx, a, start):
    """a[start:start + VALUE_DIMS] (a 1-D contiguous float32 array) as vectors."""
    if not is_f32_row(a):
        return None

    def codegen(context, builder, signature, args):
        base = vector_pointer(context, builder, signature.args[0], args[0], args[1])
        values = [builder.load(_vector(builder, base, i), align=4) for i in range(_VECTORS)]
        return context.make_tuple(builder, signature.return_type, values)

    return types.UniTuple(f32x8, _VECTORS)(a, start), codegen


@intrinsic
def _put(typingctx, a, start, vectors):
    """a[start:start + VALUE_DIMS] = the vectors."""
    if not is_f32_row(a):
        return None

    def codegen(context, builder, signature, args):
        base = vector_pointer(context, builder, signature.args[0], args[0], args[1])
        for i in range(_VECTORS):
            builder.store(builder.extract_value(args[2], i), _vector(builder, base, i), align=4)
        return context.get_dummy_value()

    return types.none(a, start, vectors), codegen


@intrinsic
def _weigh(typingctx, a, weight, v, start):
    """The accumulators plus weight times v[start:start + VALUE_DIMS], one fused multiply-add per
    lane (v float32 or bfloat16 bits, widened as loaded)."""
    if not is_row(v):
        return None

    def codegen(context, builder, signature, args):
        fma = fma_instruction(builder)
        w = splat(builder, args[1], LANES8)
        out = [builder.call(fma, [w, load8(context, builder, signature.args[2], args[2],
                                           builder.add(args[3], ir.Constant(ir.IntType(64), 8 * i))),
                                  builder.extract_value(args[0], i)]) for i in range(_VECTORS)]
        return context.make_tuple(builder, signature.return_type, out)

    return types.UniTuple(f32x8, _VECTORS)(a, weight, v, start), codegen


@numba.njit(cache=True)
def values_f32_fma(p, v, n, acc):
    """acc[r] = sum over s < n of p[r, s] * v[s] (float32), each row and dimension one chain of
    fused multiply-adds in key order: per block of keys, a row's VALUE_DIMS dimensions at a time
    in registers (whole value rows read in order, as memory streams them best)."""
    rows, dim = acc.shape
    acc[:, :] = 0.0
    for lo in range(0, n, KEY_BLOCK):
        hi = min(n, lo + KEY_BLOCK)
        for r in range(rows):
            for c in range(0, dim, VALUE_DIMS):
                a = _get(acc[r], c)
                for s in range(lo, hi):
                    a = _weigh(a, p[r, s], v[s], c)
                _put(acc[r], c, a)
