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
from numba.extending import intrinsic, overload

from triforce.kernels.cpu.simd.bf16_dot import splat
from triforce.kernels.cpu.simd.prefetch import ask_rows
from triforce.kernels.cpu.simd.f32_dot import (LANES8, STEP, dot, dot4, dot4_at, dot_at, f32x8, fma_instruction,
                                               is_flat, load8, vector_pointer)

VALUE_DIMS = 64  # dimensions a row keeps in registers (8 vectors): head dims must be a multiple
_VECTORS = VALUE_DIMS // 8
AHEAD = 32
KEY_BLOCK = 64   # keys per block of the values: 16 KB of values at head dim 64, read from L1 by every row


def fits(dim: int) -> bool:
    """Whether these kernels take a head dim."""
    return dim % STEP == 0 and dim % VALUE_DIMS == 0


def key_row(k, s):
    raise NotImplementedError("numba only: see the overload")


@overload(key_row, inline="always")
def _key_row(k, s):
    """Row s of a job's keys (or values): of a 2-D view (the decode kernels'), or of one KV head in
    a block of the host store, given as (block [tokens, 2, B, Hkv, D], K or V, batch row, head),
    where a token's row is D contiguous elements among the other heads' (the hybrid verify's)."""
    if isinstance(k, types.Array) and k.ndim == 2:
        return lambda k, s: k[s]
    if isinstance(k, types.BaseTuple) and len(k) == 4 and isinstance(k[0], types.Array) and k[0].ndim == 5:
        return lambda k, s: k[0][s, k[1], k[2], k[3]]
    return None


def score_four_keys(q, k, s, out):
    raise NotImplementedError("numba only: see the overload")


@overload(score_four_keys, inline="always")
def _score_four_keys(q, k, s, out):
    """out[r, s:s + 4] = dot4 of every row of q with keys s .. s + 3 (key_row's sources): a 2-D
    view's rows read at flat indices (no view per key, see f32_dot.fma_at), a host block's four
    rows taken once for all of q's rows."""
    if isinstance(k, types.Array) and k.ndim == 2:
        def flat(q, k, s, out):
            dim = q.shape[1]
            for r in range(q.shape[0]):
                out[r, s], out[r, s + 1], out[r, s + 2], out[r, s + 3] = dot4_at(
                    q, r * dim, k, s * dim, (s + 1) * dim, (s + 2) * dim, (s + 3) * dim, dim)
        return flat

    def rows_of(q, k, s, out):
        k0, k1, k2, k3 = key_row(k, s), key_row(k, s + 1), key_row(k, s + 2), key_row(k, s + 3)
        for r in range(q.shape[0]):
            out[r, s], out[r, s + 1], out[r, s + 2], out[r, s + 3] = dot4(q[r], k0, k1, k2, k3, q.shape[1])
    return rows_of


def key_dot(q, r, k, s, dim):
    raise NotImplementedError("numba only: see the overload")


@overload(key_dot, inline="always")
def _key_dot(q, r, k, s, dim):
    """dot of q's row r with key s, read as score_four_keys reads them."""
    if isinstance(k, types.Array) and k.ndim == 2:
        return lambda q, r, k, s, dim: dot_at(q, r * dim, k, s * dim, dim)
    return lambda q, r, k, s, dim: dot(q[r], key_row(k, s), dim)


def weigh_value(a, weight, v, s, start):
    raise NotImplementedError("numba only: see the overload")


@overload(weigh_value, inline="always")
def _weigh_value(a, weight, v, s, start):
    """_weigh with value row s (key_row's sources) from dimension `start`, at a flat index where
    the values are a 2-D view."""
    if isinstance(v, types.Array) and v.ndim == 2:
        return lambda a, weight, v, s, start: _weigh(a, weight, v, s * v.shape[1] + start)
    return lambda a, weight, v, s, start: _weigh(a, weight, key_row(v, s), start)


def ask_key_rows(k, first, count):
    raise NotImplementedError("numba only: see the overload")


@overload(ask_key_rows, inline="always")
def _ask_key_rows(k, first, count):
    """ask_rows for key_row's sources (a host block's rows lie apart: one hint each, within it)."""
    if isinstance(k, types.Array) and k.ndim == 2:
        return lambda k, first, count: ask_rows(k, first, count)
    if isinstance(k, types.BaseTuple) and len(k) == 4:
        # bfloat16 rows only: Llama-2-7B's heads over 16K host keys, two threads, against the loop
        # without hints side by side: bfloat16 1.33x GB/s, 1.43x FLOP/s at 9 tokens; float32 read
        # slower with them (43.6 -> 35.5 GB/s), as fast without (0.99x)
        if k[0].dtype != types.uint16:
            return lambda k, first, count: None

        def each_row(k, first, count):
            for s in range(first, min(first + count, k[0].shape[0])):
                ask_rows(k[0][s, k[1], k[2]], k[3], 1)
        return each_row
    return None


@numba.njit(cache=True)
def scores_f32_fma(q, k, n, out):
    """out[r, s] = q[r] . k[s] for s < n (float32; q already scaled; k's rows float32 or bfloat16
    bits, see key_row): four keys at a time, every row right after they are read (a job's keys
    stream from memory once, evenly)."""
    rows, dim = q.shape
    s = 0
    while s + 4 <= n:
        if s + AHEAD + 4 <= n:
            ask_key_rows(k, s + AHEAD, 4)
        score_four_keys(q, k, s, out)
        s += 4
    while s < n:
        for r in range(rows):
            out[r, s] = key_dot(q, r, k, s, dim)
        s += 1


def _vector(builder, base, i):
    return builder.gep(base, [ir.Constant(ir.IntType(64), i)])


@intrinsic
def _get(typingctx, a, start):
    """a[start:start + VALUE_DIMS] (a C-contiguous float32 array, start a flat index) as vectors."""
    if not (is_flat(a) and a.dtype == types.float32):
        return None

    def codegen(context, builder, signature, args):
        base = vector_pointer(context, builder, signature.args[0], args[0], args[1])
        values = [builder.load(_vector(builder, base, i), align=4) for i in range(_VECTORS)]
        return context.make_tuple(builder, signature.return_type, values)

    return types.UniTuple(f32x8, _VECTORS)(a, start), codegen


@intrinsic
def _put(typingctx, a, start, vectors):
    """a[start:start + VALUE_DIMS] = the vectors (as _get)."""
    if not (is_flat(a) and a.dtype == types.float32):
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
    lane (v float32 or bfloat16 bits, widened as loaded; any shape, start a flat index)."""
    if not is_flat(v):
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
                a = _get(acc, r * dim + c)
                for s in range(lo, hi):
                    a = weigh_value(a, p[r, s], v, s, c)
                _put(acc, r * dim + c, a)
