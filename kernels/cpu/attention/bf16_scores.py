"""Attention scores of bfloat16 queries and keys on the CPU's bfloat16 dot instruction
(AVX512-BF16, see triforce.kernels.cpu.simd.bf16_dot), for the attention kernel's verify passes.

Why: a verify pass of 9 tokens over a 32K-token cache computes 27 query rows per KV head of
the default model against every key, and there the scores are compute-bound (the KV is read
once for all rows). Widening each key to float32 for every row and summing each 64-wide dot
across a vector's lanes cost ~60 us per 512 keys on this project's box; here 16 keys go at once:
each key's products into its own accumulator, then one transposing tree sums the 16
accumulators' lanes into a vector of 16 scores (4 levels of shuffles, 15 additions per 16 keys,
where a lone key takes 4 of each): 1.9-2.4x at 9 and 27 rows, 1.2-2x at 3, two runs
(bench/history/2026-11-23-24-cpu-vs-llamacpp-avx512.md).

A key's lanes are added in the same pairs in the group's tree as `lane_tree` adds a lone key's
(lane i with i + 8, then i + 4, i + 2, i + 1), so a score has the same bits whether its key is in
a group of 16 or in the remainder, and a query row's scores never depend on the other rows: a
verify pass scores each token as a decoding step would. Scores are scale * (q . k), the products
exact and the sums float32."""
from __future__ import annotations

import numba
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

import numpy as np

from triforce.kernels.cpu.simd.bf16_dot import (LANES, dot_instruction, dot_step, f32x16, operand_at, row_pointers,
                                       splat, sum16, zeros)
from triforce.kernels.cpu.attention.bf16_key_pairs import TURNED_BLOCKS, score_rows, turn_block
from triforce.kernels.cpu.simd.prefetch import ask_rows

GROUP = 16  # keys per group: one vector of scores
# From this many query rows on, scores_turned: per 512 keys of head dim 64, 27 rows 15.2 -> 9.6 us,
# 9 rows 5.4 -> 4.3, 3 rows 2.4 -> 2.6 (bench/history/2026-11-23-24-cpu-vs-llamacpp-avx512.md); a verify
# of 2 tokens has 6.
TURN_ROWS = 6
TURNED_DIMS = tuple(32 * blocks for blocks in TURNED_BLOCKS)
# Keys asked for ahead of the group being scored (triforce.kernels.cpu.simd.prefetch): at 32K tokens, 30
# layers on two threads, a decoding step's attention 36 -> 30 ms, a 9-token verify's 108 -> 96 ms
# (32 to 256 keys ahead did the same).
AHEAD = 64


@intrinsic
def _zeros_group(typingctx):
    group = types.UniTuple(f32x16, GROUP)
    return group(), lambda context, builder, signature, args: context.make_tuple(
        builder, group, [ir.Constant(LANES, None)] * GROUP)


@intrinsic
def _group_step(typingctx, accs, k, first, q, start):
    """accs[j] + the pairwise products of k[first + j, start:start + 32] and q[start:start + 32]."""
    if not all(isinstance(a, types.Array) and a.dtype == types.uint16 for a in (k, q)) or k.ndim != 2:
        return None

    def codegen(context, builder, signature, args):
        accs_in, keys, first_key, query, start_at = args
        q_operand = operand_at(builder, builder.gep(context.make_array(signature.args[3])(context, builder, query).data,
                                                    [start_at]))
        key_array = context.make_array(signature.args[1])(context, builder, keys)
        out = []
        for j, pointer in enumerate(row_pointers(builder, key_array, first_key, start_at, GROUP, hide=True)):
            out.append(builder.call(dot_instruction(builder),
                                    [builder.extract_value(accs_in, j), operand_at(builder, pointer), q_operand]))
        return context.make_tuple(builder, signature.return_type, out)

    return accs(accs, k, first, q, start), codegen


def _halve(builder, x, y, partials):
    """x, y each hold keys of `partials` lanes: the keys of x then of y, half the partials each."""
    half, low, high = partials // 2, [], []
    for base in range(0, 32, partials):
        low += range(base, base + half)
        high += range(base + half, base + partials)
    lanes = lambda picks: ir.Constant(ir.VectorType(ir.IntType(32), 16), picks)  # noqa: E731
    return builder.fadd(builder.shuffle_vector(x, y, lanes(low)), builder.shuffle_vector(x, y, lanes(high)))


@intrinsic
def _store_group(typingctx, accs, scale, out, start):
    """out[start + j] = scale * (the sum of accs[j]'s lanes) for j < 16 (out 1-D float32, contiguous)."""
    def codegen(context, builder, signature, args):
        vectors, partials = [builder.extract_value(args[0], j) for j in range(GROUP)], 16
        while len(vectors) > 1:
            vectors = [_halve(builder, vectors[i], vectors[i + 1], partials) for i in range(0, len(vectors), 2)]
            partials //= 2
        scale = splat(builder, args[1], LANES)
        data = context.make_array(signature.args[2])(context, builder, args[2]).data
        builder.store(builder.fmul(vectors[0], scale), builder.bitcast(builder.gep(data, [args[3]]),
                                                                       LANES.as_pointer()), align=4)
        return context.get_dummy_value()

    return types.none(accs, scale, out, start), codegen


@numba.njit(cache=True)
def scores_grouped(q, k, full, scale, out):
    """out[r, s] = scale * (q[r] . k[s]) for s < full (a multiple of GROUP), each key its own
    accumulator: the faster for a few rows."""
    rows, dim = q.shape
    for first in range(0, full, GROUP):
        ask_rows(k, first + AHEAD, GROUP)
        for r in range(rows):
            accs = _zeros_group()
            for start in range(0, dim, 32):
                accs = _group_step(accs, k, first, q[r], start)
            _store_group(accs, scale, out[r], first)


@numba.njit(cache=True)
def scores_turned(q, k, full, scale, out):
    """scores_grouped's result, bit for bit, by keys turned pair by pair once per group and
    three rows sharing each load (triforce.kernels.cpu.attention.bf16_key_pairs): the faster for many rows.
    Head dims 32, 64 and 128 only (see TURNED_DIMS)."""
    rows, dim = q.shape
    turned = np.empty(GROUP * dim, np.uint16)
    for first in range(0, full, GROUP):
        ask_rows(k, first + AHEAD, GROUP)
        for start in range(0, dim, 32):
            turn_block(k, first, turned, start)
        for r in range(0, rows, 3):
            _score_rows(turned, q, r, min(3, rows - r), scale, out, first, dim // 32)


@numba.njit(inline="always")
def _score_rows(turned, q, r, size, scale, out, first, blocks):
    """score_rows with its literal row count spelled out (one compiled body per count)."""
    if size == 3:
        score_rows(turned, q, r, scale, out, first, 3, blocks)
    elif size == 2:
        score_rows(turned, q, r, scale, out, first, 2, blocks)
    else:
        score_rows(turned, q, r, scale, out, first, 1, blocks)


@numba.njit(cache=True)
def scores_bf16_pairs(q, k, n, scale, out):
    """out[r, s] = scale * (q[r] . k[s]) for s < n: q [rows, dim], k [>= n, dim] bfloat16 bits
    (rows of dim contiguous), dim a multiple of 32, out float32 [rows, >= n] C-contiguous."""
    rows, dim = q.shape
    full = n - n % GROUP
    if rows >= TURN_ROWS and dim in TURNED_DIMS:
        scores_turned(q, k, full, scale, out)
    else:
        scores_grouped(q, k, full, scale, out)
    for s in range(full, n):
        for r in range(rows):
            acc = zeros()
            for start in range(0, dim, 32):
                acc = dot_step(acc, k[s], q[r], start)
            out[r, s] = sum16(acc) * scale
