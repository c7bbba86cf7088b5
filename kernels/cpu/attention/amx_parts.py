"""An attention job's scores and weighted values on AMX tiles (triforce.kernels.cpu.simd.amx),
for bfloat16 on CPUs that have them: the AMX path of triforce.kernels.cpu.attention.decode.

Scores: for each group of 16 keys, the keys are turned pair by pair (bf16_key_pairs.turn_block:
row p of the tile holds dims 2p, 2p + 1 of all 16 keys) and one tile product per 32 dims gives
16 query rows x 16 keys. Values: the weights rounded to bfloat16 (as the other bfloat16 paths and
PyTorch round them) are the left tile, 16 rows x 32 keys, and the values of each pair of keys
are interleaved dim by dim (row k of a tile: dims d .. d + 15 of keys 2k and 2k + 1 side by side),
four tiles of 16 sums for 64 dims. Query rows come in blocks of 16, the missing ones zeros.

A query row's numbers depend only on its own row of each left tile, and keys a row may not see
weigh an exact 0 (values past the job's keys are zeros, never whatever the cache holds there),
so a row's result is the same whatever the call's other rows and key count: the kernel stays
batch-invariant and a verify pass computes each token as decoding it alone would."""
from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from triforce.kernels.cpu.attention.bf16_key_pairs import turn_block
from triforce.kernels.cpu.attention.bf16_values import rounded16
from triforce.kernels.cpu.simd.amx import TILE_ROWS, dot, load, store, zero
from triforce.kernels.cpu.simd.prefetch import ask_rows

GROUP = 16  # keys per scores tile
CHUNK = 64  # dims per pass of the values: four tiles of 16 sums
AHEAD = 64  # keys asked for ahead of the group being turned (as bf16_scores)


@intrinsic
def _spread(typingctx, p, start, even, odd):
    """even[start:start + 16] = the bfloat16 bits of p[start:start + 16] in each lane's low half,
    odd[...] the same in the high half (p 1-D float32, even and odd 1-D uint32, contiguous)."""
    def codegen(context, builder, signature, args):
        halves = rounded16(context, builder, signature.args[0], args[0], args[1])
        shifted = builder.shl(halves, ir.Constant(halves.type, [16] * 16))
        for which, vector in ((2, halves), (3, shifted)):
            data = context.make_array(signature.args[which])(context, builder, args[which]).data
            builder.store(vector, builder.bitcast(builder.gep(data, [args[1]]), halves.type.as_pointer()), align=4)
        return context.get_dummy_value()

    return types.none(p, types.intp, even, odd), codegen


@numba.njit(cache=True)
def scores_amx(q, k, n, scale, out, turned, tail, seen_rows):
    """out[r, s] = scale * (q[r] . k[s]) for s < n and every row of q: q [R, dim] bfloat16 bits,
    R a multiple of TILE_ROWS (rows past the caller's zeros), dim a multiple of 32; k [>= n, dim];
    out float32 [R, >= n rounded up to 16], C-contiguous. turned: uint16 [16 * dim] scratch; tail:
    uint16 [16, dim] scratch (the last keys, zero-padded, never rows past k's n). Rows from
    seen_rows on are left unscaled (nobody reads them). Tiles configured by the caller."""
    dim = q.shape[1]
    full = n - n % GROUP
    for first in range(0, full, GROUP):
        ask_rows(k, first + AHEAD, GROUP)
        for start in range(0, dim, 32):
            turn_block(k, first, turned, start)
        _score_group(q, turned, out, first)
    if full < n:
        tail[:] = 0
        tail[:n - full] = k[full:n]
        for start in range(0, dim, 32):
            turn_block(tail, 0, turned, start)
        _score_group(q, turned, out, full)
    span = full + (GROUP if full < n else 0)
    for r in range(seen_rows):
        for s in range(span):
            out[r, s] *= scale


@numba.njit(inline="always")
def _score_group(q, turned, out, first):
    rows, dim = q.shape
    width = out.shape[1]
    for block in range(0, rows, TILE_ROWS):
        zero(0)
        for b in range(dim // 32):
            load(4, q, block * dim + 32 * b, 2 * dim)
            load(6, turned, 512 * b, 64)
            dot(0, 4, 6)
        store(0, out, block * width + first, 4 * width)


@numba.njit(cache=True)
def values_amx(p, v, n, seen_rows, acc, even, odd, tail):
    """acc[r] = sum over s < n of bfloat16(p[r, s]) * v[s] for r < seen_rows: p float32 [R, >= n
    rounded up to 16], zero past each row's visible keys; v [>= n, dim] bfloat16 bits, rows
    contiguous, dim a multiple of CHUNK; acc float32 [R, dim], R a multiple of TILE_ROWS. even,
    odd: uint32 [R, >= n rounded up to 16] scratch, zeros in rows from seen_rows on; tail: uint16
    [16, dim] scratch. Tiles configured by the caller.

    The value rows go into the tiles as they lie, 16 keys of 32 dims (dims 2i, 2i + 1 a pair),
    and the weights twice, each beside a zero: `even` pairs a key's weight with dim 2i (the sums
    of even dims), `odd` with dim 2i + 1; no value is moved before it is multiplied."""
    rows, dim = acc.shape
    groups = (n + GROUP - 1) // GROUP
    for r in range(seen_rows):
        for s in range(0, groups * GROUP, 16):
            _spread(p[r], s, even[r], odd[r])
    full = n - n % GROUP
    if full < n:
        tail[:] = 0
        tail[:n - full] = v[full:n]
    width, stride = even.shape[1], v.strides[0]
    for block in range(0, rows, TILE_ROWS):
        for dim0 in range(0, dim, CHUNK):
            zero(0)
            zero(1)
            zero(2)
            zero(3)
            for g in range(groups):
                first = g * GROUP
                load(4, even, block * width + first, 4 * width)
                load(5, odd, block * width + first, 4 * width)
                if first < full:
                    load(6, v, first * (stride // 2) + dim0, stride)
                    load(7, v, first * (stride // 2) + dim0 + 32, stride)
                else:
                    load(6, tail, dim0, 2 * dim)
                    load(7, tail, dim0 + 32, 2 * dim)
                dot(0, 4, 6)
                dot(1, 5, 6)
                dot(2, 4, 7)
                dot(3, 5, 7)
            for j in range(4):
                _store_sums(j, acc, block * dim + dim0 + 16 * j, 4 * dim)
        _unpair(acc, block, min(TILE_ROWS, seen_rows - block))


@numba.njit(inline="always")
def _store_sums(j, acc, at, stride):
    if j == 0:
        store(0, acc, at, stride)
    elif j == 1:
        store(1, acc, at, stride)
    elif j == 2:
        store(2, acc, at, stride)
    else:
        store(3, acc, at, stride)


@numba.njit(inline="always")
def _unpair(acc, block, rows):
    """Each 32 dims of acc's rows block .. block + rows - 1 hold the even dims' sums, then the
    odd's: put them in order."""
    dim = acc.shape[1]
    row = np.empty(32, np.float32)
    for r in range(block, block + rows):
        for dim0 in range(0, dim, 32):
            for i in range(16):
                row[2 * i] = acc[r, dim0 + i]
                row[2 * i + 1] = acc[r, dim0 + 16 + i]
            acc[r, dim0:dim0 + 32] = row
