"""The attention kernel's scores and weighted values for float32 on CPUs with FMA (AVX2), on the
explicit vectors of triforce.kernels.f32_dot.

Why: with the sums left to LLVM's vectoriser, a verify job (27 query rows by 512 keys, head dim
64) took 96 us for its scores and 65 for its values on a 2-core Zen 3, ~20 GFLOP/s: each score
summed its lanes alone, and the values re-read and re-wrote each row's accumulator for every
four keys. Here a query row is read once for four keys (the f32_dot steps, eight chains), and a
pair of rows keeps 32 dimensions of its weighted values in registers for a block of keys, each
key's values read once for both rows.

Batch-invariant as the rest of the kernel: a score is `f32_dot.dot(q, k)` whatever the group it
is computed in, and a row's weighted values are one chain of fused multiply-adds over its keys in
order (keys it may not see weigh an exact 0 and leave the sums as they are), the same for a row
alone or paired, so a verify pass computes each token as decoding it alone would."""
from __future__ import annotations

import numba
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from triforce.kernels.bf16_dot import splat
from triforce.kernels.f32_dot import LANES8, STEP, is_f32_row, dot, dot4, f32x8, fma_instruction

VALUE_DIMS = 32  # dimensions a row pair keeps in registers (2 x 4 vectors): head dims must be a multiple
KEY_BLOCK = 64   # keys per block of the values: 16 KB of values at head dim 64, read from L1 by every row


@numba.njit(inline="always")
def fits(dim):
    """Whether these kernels take a head dim."""
    return dim % STEP == 0 and dim % VALUE_DIMS == 0


@numba.njit(cache=True)
def scores_f32_fma(q, k, n, out):
    """out[r, s] = q[r] . k[s] for s < n (float32; q already scaled), keys four at a time."""
    rows, dim = q.shape
    for lo in range(0, n, KEY_BLOCK):
        hi = min(n, lo + KEY_BLOCK)
        for r in range(rows):
            qr = q[r]
            s = lo
            while s + 4 <= hi:
                out[r, s], out[r, s + 1], out[r, s + 2], out[r, s + 3] = dot4(qr, k[s], k[s + 1], k[s + 2], k[s + 3], dim)
                s += 4
            while s < hi:
                out[r, s] = dot(qr, k[s], dim)
                s += 1


def _pointer(context, builder, array_type, array, start):
    data = context.make_array(array_type)(context, builder, array).data
    return builder.bitcast(builder.gep(data, [start]), LANES8.as_pointer())


@intrinsic
def _get4(typingctx, a, start):
    """a[start:start + 32] (a 1-D contiguous float32 array) as four vectors."""
    if not is_f32_row(a):
        return None

    def codegen(context, builder, signature, args):
        base = _pointer(context, builder, signature.args[0], args[0], args[1])
        values = [builder.load(builder.gep(base, [ir.Constant(ir.IntType(64), i)]), align=4) for i in range(4)]
        return context.make_tuple(builder, signature.return_type, values)

    return types.UniTuple(f32x8, 4)(a, start), codegen


@intrinsic
def _put4(typingctx, a, start, vectors):
    """a[start:start + 32] = the four vectors."""
    if not is_f32_row(a):
        return None

    def codegen(context, builder, signature, args):
        base = _pointer(context, builder, signature.args[0], args[0], args[1])
        for i in range(4):
            builder.store(builder.extract_value(args[2], i), builder.gep(base, [ir.Constant(ir.IntType(64), i)]), align=4)
        return context.get_dummy_value()

    return types.none(a, start, vectors), codegen


@intrinsic
def _weigh2(typingctx, a, b, pa, pb, v, start):
    """Two rows' accumulators (four vectors each) plus pa and pb times v[start:start + 32]: the
    value vectors loaded once for both rows, each lane one fused multiply-add."""
    if not is_f32_row(v):
        return None

    def codegen(context, builder, signature, args):
        base = _pointer(context, builder, signature.args[4], args[4], args[5])
        fma = fma_instruction(builder)
        wa, wb = splat(builder, args[2], LANES8), splat(builder, args[3], LANES8)
        out_a, out_b = [], []
        for i in range(4):
            value = builder.load(builder.gep(base, [ir.Constant(ir.IntType(64), i)]), align=4)
            out_a.append(builder.call(fma, [wa, value, builder.extract_value(args[0], i)]))
            out_b.append(builder.call(fma, [wb, value, builder.extract_value(args[1], i)]))
        four = signature.return_type.types[0]
        return context.make_tuple(builder, signature.return_type, [
            context.make_tuple(builder, four, out_a), context.make_tuple(builder, four, out_b)])

    four = types.UniTuple(f32x8, 4)
    return types.Tuple((four, four))(a, b, pa, pb, v, start), codegen


@numba.njit(cache=True)
def values_f32_fma(p, v, n, acc):
    """acc[r] = sum over s < n of p[r, s] * v[s] (float32), each row and dimension one chain of
    fused multiply-adds in key order; rows two at a time (a last odd row with itself)."""
    rows, dim = acc.shape
    acc[:, :] = 0.0
    for lo in range(0, n, KEY_BLOCK):
        hi = min(n, lo + KEY_BLOCK)
        for r in range(0, rows, 2):
            r2 = min(r + 1, rows - 1)  # an odd last row is paired with itself: same sums, stored twice
            for c in range(0, dim, VALUE_DIMS):
                a = _get4(acc[r], c)
                b = _get4(acc[r2], c)
                for s in range(lo, hi):
                    a, b = _weigh2(a, b, p[r, s], p[r2, s], v[s], c)
                _put4(acc[r], c, a)
                _put4(acc[r2], c, b)
