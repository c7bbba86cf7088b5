"""Attention's weighted values (sum over keys s of p[r, s] * v[s]) for bfloat16 values on the
CPU's bfloat16 dot instruction (AVX512-BF16, see triforce.kernels.cpu.simd.bf16_dot).

Why: a verify pass of 9 tokens over a long cache weighs every value row for 27 query rows per
KV head of the default model, compute-bound (the values are read once for all rows). Here a
pair of keys is one instruction per 16 dims: the two value rows interleaved (dim d of key s
beside dim d of key s + 1, by register shuffles shared by the rows of a block) against the
row's two weights broadcast, so each lane adds v[s, d] p[s] + v[s + 1, d] p[s + 1].

The weights are rounded to bfloat16 first, as PyTorch's own CPU attention does for bfloat16
(its softmax's sum stays float32, as here). A row's sums take the same instructions in the same
order whether it goes in a block of six rows or alone, and keys a row may not see weigh an
exact 0 (an odd last key is paired with a zero row), so a query row's result never depends on
the other rows or on the call's key count: batch-invariant, as the rest of the kernel."""
from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from triforce.kernels.cpu.simd.bf16_bits import narrow
from triforce.kernels.cpu.simd.bf16_dot import LANES, OPERAND, dot_instruction, f32x16, splat

CHUNK = 64  # dims per pass over the keys: four accumulators of 16 lanes per row
_HALF = ir.VectorType(ir.IntType(16), 32)  # 32 bfloat16 values as loaded


def _zeros_for(rows):
    group = types.UniTuple(f32x16, 4 * rows)

    @intrinsic
    def zeros(typingctx):
        """Four accumulators (64 dims) per row for `rows` rows."""
        return group(), lambda context, builder, signature, args: context.make_tuple(
            builder, group, [ir.Constant(LANES, None)] * (4 * rows))

    return zeros


_z1, _z2, _z3, _z4, _z5, _z6 = (_zeros_for(rows) for rows in range(1, 7))
BLOCK = 6  # rows sharing a pass's loads and shuffles: 24 accumulators, registers to spare


@intrinsic
def _step(typingctx, accs, v, s, dim0, weights, r, pair):
    """accs + for each row r + i (len(accs) / 4 rows), the pair of keys (s, s + 1) over dims
    dim0 .. dim0 + 63: v[s + j, d] weighted by weights[r + i, pair] (two bfloat16 in 32 bits)."""
    rows = accs.count // 4

    def codegen(context, builder, signature, args):
        accs_in, values, key, first_dim, w, row, pair_at = args
        array = context.make_array(signature.args[1])(context, builder, values)
        halves = []
        for j in (0, 1):
            for offset in (0, 32):
                pointer = _item(context, builder, signature.args[1], array, builder.add(key, _i64(j)),
                                builder.add(first_dim, _i64(offset)))
                halves.append(builder.load(builder.bitcast(pointer, _HALF.as_pointer()), align=2))
        operands = []  # dims 16q .. 16q + 15 of both keys, interleaved
        for q in range(4):
            source = q // 2
            picks = [lane for d in range(16 * (q % 2), 16 * (q % 2) + 16) for lane in (d, 32 + d)]
            mixed = builder.shuffle_vector(halves[source], halves[2 + source],
                                           ir.Constant(ir.VectorType(ir.IntType(32), 32), picks))
            operands.append(builder.bitcast(builder.bitcast(mixed, ir.VectorType(ir.IntType(32), 16)),
                                            OPERAND))
        w_array = context.make_array(signature.args[4])(context, builder, w)
        out = []
        for i in range(rows):
            pointer = _item(context, builder, signature.args[4], w_array, builder.add(row, _i64(i)), pair_at)
            weight = builder.bitcast(splat(builder, builder.load(pointer), ir.VectorType(ir.IntType(32), 16)),
                                     OPERAND)
            for q in range(4):
                out.append(builder.call(dot_instruction(builder),
                                        [builder.extract_value(accs_in, 4 * i + q), operands[q], weight]))
        return context.make_tuple(builder, signature.return_type, out)

    return accs(accs, v, types.intp, types.intp, weights, types.intp, types.intp), codegen


@intrinsic
def _store(typingctx, accs, out, r, dim0):
    """out[r + i, dim0 + 16 q + l] = lane l of accs[4 i + q]."""
    rows = accs.count // 4

    def codegen(context, builder, signature, args):
        array = context.make_array(signature.args[1])(context, builder, args[1])
        for i in range(rows):
            for q in range(4):
                pointer = _item(context, builder, signature.args[1], array, builder.add(args[2], _i64(i)),
                                builder.add(args[3], _i64(16 * q)))
                builder.store(builder.extract_value(args[0], 4 * i + q),
                              builder.bitcast(pointer, LANES.as_pointer()), align=4)
        return context.get_dummy_value()

    return types.none(accs, out, types.intp, types.intp), codegen


def _i64(n):
    return ir.Constant(ir.IntType(64), n)


def _item(context, builder, array_type, array, i, j):
    return cgutils.get_item_pointer(context, builder, array_type, array, [i, j], wraparound=False)


_U32x16 = ir.VectorType(ir.IntType(32), 16)


def rounded16(context, builder, array_type, array, start):
    """The 16 floats array[start:start + 16] (1-D float32, contiguous) rounded to bfloat16 bits
    (to nearest even; a NaN stays a NaN, as bf16_bits.narrow), each in the low half of a 32-bit lane."""
    source = context.make_array(array_type)(context, builder, array).data
    bits = builder.load(builder.bitcast(builder.gep(source, [start]), _U32x16.as_pointer()), align=4)
    const = lambda v: ir.Constant(_U32x16, [v] * 16)  # noqa: E731
    odd = builder.and_(builder.lshr(bits, const(16)), const(1))
    rounded = builder.lshr(builder.add(builder.add(bits, const(0x7FFF)), odd), const(16))
    nan = builder.icmp_unsigned(">", builder.and_(bits, const(0x7FFFFFFF)), const(0x7F800000))
    return builder.select(nan, builder.or_(builder.lshr(bits, const(16)), const(0x40)), rounded)


@intrinsic
def _round16(typingctx, p, start, out):
    """The 16 floats p[start:start + 16] rounded to bfloat16 bits (to nearest even; a NaN stays a
    NaN, as bf16_bits.narrow) into the 16 halves of out[start // 2:start // 2 + 8] (p 1-D float32,
    out 1-D uint32, both contiguous; start even): lane-wise integer operations, where narrow's
    scalar loop took 0.4 ns per value."""
    def codegen(context, builder, signature, args):
        halves = rounded16(context, builder, signature.args[0], args[0], args[1])
        target = context.make_array(signature.args[2])(context, builder, args[2]).data
        half = builder.gep(builder.bitcast(target, ir.IntType(16).as_pointer()), [args[1]])
        builder.store(builder.trunc(halves, ir.VectorType(ir.IntType(16), 16)),
                      builder.bitcast(half, ir.VectorType(ir.IntType(16), 16).as_pointer()), align=2)
        return context.get_dummy_value()

    return types.none(p, types.intp, out), codegen


@numba.njit(cache=True)
def weight_pairs(p, n, out):
    """out[r, k] = bfloat16 bits of p[r, 2k] (low half) and p[r, 2k + 1] (high; 0 past n)."""
    rows = p.shape[0]
    full = n - n % 16
    bits = np.empty(1, np.uint16)
    for r in range(rows):
        for s in range(0, full, 16):
            _round16(p[r], s, out[r])
        for k in range(full // 2, (n + 1) // 2):
            low = np.uint32(narrow(p[r, 2 * k], bits))
            high = np.uint32(narrow(p[r, 2 * k + 1], bits)) if 2 * k + 1 < n else np.uint32(0)
            out[r, k] = low | (high << np.uint32(16))


@numba.njit(inline="always")
def _weigh(accs, v, n, dim0, weights, r, pad):
    """accs plus the weighted values of keys 0 .. n - 1 for the rows accs holds (an odd last key
    paired with a zero row)."""
    pairs = n // 2
    for k in range(pairs):
        accs = _step(accs, v, 2 * k, dim0, weights, r, k)
    if n % 2:
        pad[0] = v[n - 1]
        pad[1] = 0
        accs = _step(accs, pad, 0, dim0, weights, r, pairs)
    return accs


@numba.njit(cache=True)
def values_bf16_pairs(p, v, n, acc, pad, weights):
    """acc[r] = sum over s < n of bfloat16(p[r, s]) * v[s]: p [rows, >= n] float32, v [>= n, dim]
    bfloat16 bits, dim a multiple of CHUNK; acc float32 [rows, dim]. pad: uint16 [2, dim]
    scratch; weights: uint32 [rows, >= (n + 1) // 2] scratch."""
    rows, dim = acc.shape
    weight_pairs(p, n, weights)
    for dim0 in range(0, dim, CHUNK):
        for r in range(0, rows, BLOCK):
            _weigh_block(min(BLOCK, rows - r), v, n, dim0, weights, r, pad, acc)


@numba.njit(inline="always")
def _weigh_block(size, v, n, dim0, weights, r, pad, acc):
    """Rows r .. r + size - 1 (size <= BLOCK) in one pass: a block of 3 rows once cost three
    passes of one (2.4 -> 1.7 us for 3 rows of 512 keys; 27 rows 11.5 -> 10.0 in blocks of 6)."""
    if size == 6:
        _store(_weigh(_z6(), v, n, dim0, weights, r, pad), acc, r, dim0)
    elif size == 5:
        _store(_weigh(_z5(), v, n, dim0, weights, r, pad), acc, r, dim0)
    elif size == 4:
        _store(_weigh(_z4(), v, n, dim0, weights, r, pad), acc, r, dim0)
    elif size == 3:
        _store(_weigh(_z3(), v, n, dim0, weights, r, pad), acc, r, dim0)
    elif size == 2:
        _store(_weigh(_z2(), v, n, dim0, weights, r, pad), acc, r, dim0)
    else:
        _store(_weigh(_z1(), v, n, dim0, weights, r, pad), acc, r, dim0)
