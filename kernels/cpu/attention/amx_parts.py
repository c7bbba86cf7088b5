"""An attention job's scores and weighted values on AMX tiles (triforce.kernels.cpu.simd.amx),
for bfloat16 on CPUs that have them: the AMX path of triforce.kernels.cpu.attention.decode.

Neither keys nor values are moved before they are multiplied: both tiles take 16 rows of the
cache as they lie (32 dims of each key, bfloat16 pairs side by side). Scores: the keys are the
left tile and the query rows, turned once per call (row p: dims 2p, 2p + 1 of each query row),
the right one: 16 keys x R rows of sums, turned into rows of scores in registers. Values: the
weights, rounded to bfloat16 (as the other bfloat16 paths and PyTorch round them), are the left
tile twice, each weight beside a zero: beside dim 2i of its key's pair it sums the even dims,
beside dim 2i + 1 the odd ones. Query rows come in blocks of R (all of a call's up to 16).
Against the AVX512-BF16 path on this project's AMX Xeon: see bench/RESULTS.md, "AMX attention".

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

from triforce.kernels.cpu.attention.bf16_key_pairs import turn_scores
from triforce.kernels.cpu.attention.bf16_values import rounded16
from triforce.kernels.cpu.simd.amx import TILE_ROWS, dot, load, store, zero
from triforce.kernels.cpu.simd.prefetch import ask_rows

GROUP = 16  # keys per tile
# The tiles: a values pass (32 dims) sums even and odd dims apart; scores are 16 keys x R rows
SUMS_EVEN, SUMS_ODD, WEIGHTS_EVEN, WEIGHTS_ODD, VALUES, SCORES, KEYS, QUERIES = range(8)
CHUNK = 32  # dims per pass of the values: even and odd dims' tiles of 16 sums
AHEAD = 256  # keys asked for ahead (64, as bf16_scores: decoding at 26K keys ~10% slower than 256 or 512)


@intrinsic
def _spread(typingctx, p, start, even, odd, at):
    """even[at:at + 16] = the bfloat16 bits of p[start:start + 16] in each lane's low half, odd[at:
    at + 16] the same in the high half (p 1-D float32, even and odd 1-D uint32, contiguous)."""
    def codegen(context, builder, signature, args):
        halves = rounded16(context, builder, signature.args[0], args[0], args[1])
        shifted = builder.shl(halves, ir.Constant(halves.type, [16] * 16))
        for which, vector in ((2, halves), (3, shifted)):
            data = context.make_array(signature.args[which])(context, builder, args[which]).data
            builder.store(vector, builder.bitcast(builder.gep(data, [args[4]]), halves.type.as_pointer()), align=4)
        return context.get_dummy_value()

    return types.none(p, types.intp, even, odd, types.intp), codegen


@numba.njit(cache=True)
def tile_shapes(rows):
    """Each tile's (rows, bytes) for a call of `rows` query rows (see the module's tiles): query
    rows go in blocks of block_rows(rows)."""
    r = block_rows(rows)
    shapes = np.zeros((8, 2), np.int64)
    for tile, shape in ((SUMS_EVEN, (r, 64)), (SUMS_ODD, (r, 64)), (WEIGHTS_EVEN, (r, 64)),
                        (WEIGHTS_ODD, (r, 64)), (VALUES, (16, 64)), (SCORES, (16, 4 * r)), (KEYS, (16, 64)),
                        (QUERIES, (16, 4 * r))):
        shapes[tile, 0], shapes[tile, 1] = shape
    return shapes


@numba.njit(inline="always")
def block_rows(rows):
    return rows if rows <= TILE_ROWS else TILE_ROWS


@numba.njit(cache=True)
def turned_queries(q, padded):
    """q [heads, rows, dim] bfloat16 bits -> uint32 [heads, padded / R, dim / 32, 16, 16] (R =
    block_rows): for each block of R rows and 32 dims, row p holds pair p (dims 2p, 2p + 1) of
    each of the block's rows, a row per lane; rows past q's are zeros."""
    heads, rows, dim = q.shape
    r_block = block_rows(rows)
    out = np.zeros((heads, padded // r_block, dim // 32, 16, 16), np.uint32)
    for h in range(heads):
        for r in range(rows):
            for d in range(0, dim, 2):
                pair = np.uint32(q[h, r, d]) | (np.uint32(q[h, r, d + 1]) << np.uint32(16))
                out[h, r // r_block, d // 32, (d % 32) // 2, r % r_block] = pair
    return out


@numba.njit(cache=True)
def scores_amx(turned, k, n, scale, out, scores, tail, seen_rows):
    """out[r, s] = scale * (q[r] . k[s]) for s < n, r < seen_rows: turned = turned_queries(q)[h];
    k [>= n, dim] bfloat16 bits, rows contiguous, dim a multiple of 32; out float32 [>= seen_rows
    rounded up to R, >= n rounded up to 16], C-contiguous. scores: float32 [16, 16] scratch;
    tail: uint16 [16, dim] scratch (the last keys, zero-padded: never a row past k's n). Tiles
    configured by the caller (tile_shapes)."""
    dim = k.shape[1]
    full = n - n % GROUP
    stride = k.strides[0]
    for first in range(0, full, GROUP):
        ask_rows(k, first + AHEAD, GROUP)
        _score_group(turned, k, first * (stride // 2), stride, out, scores, scale, first, seen_rows, dim)
    if full < n:
        _score_group(turned, _last_keys(k, full, n, tail), 0, 2 * dim, out, scores, scale, full, seen_rows, dim)


@numba.njit(inline="always")
def _last_keys(rows, full, n, tail):
    """tail = rows full .. n - 1 (fewer than GROUP), then zeros: a tile's 16 rows that never
    reach past the view."""
    tail[:] = 0
    tail[:n - full] = rows[full:n]
    return tail


@numba.njit(inline="always")
def _score_group(turned, k, at, stride, out, scores, scale, first, seen_rows, dim):
    """16 keys (k's rows from element `at`) against each block of query rows: 16 keys x R rows
    of sums, turned into out's rows."""
    blocks, r_block = turned.shape[0], block_rows(seen_rows)
    for block in range(blocks):
        zero(SCORES)
        for b in range(dim // 32):
            load(KEYS, k, at + 32 * b, stride)
            load(QUERIES, turned, (block * (dim // 32) + b) * 256, 64)
            dot(SCORES, KEYS, QUERIES)
        store(SCORES, scores, 0, 64)
        turn_scores(scores, scale, out, block * r_block, first, min(r_block, seen_rows - block * r_block))


@numba.njit(cache=True)
def values_amx(p, v, n, seen_rows, acc, even, odd, tail):
    """acc[r] = sum over s < n of bfloat16(p[r, s]) * v[s] for r < seen_rows: p float32 [>=
    seen_rows, >= n rounded up to 16], zero past each row's visible keys; v [>= n, dim] bfloat16
    bits, rows contiguous, dim a multiple of CHUNK; acc float32 [P, dim], P seen_rows rounded up
    to R (block_rows). even, odd: uint32 [>= P * (n rounded up to 16)] scratch, laid out group by
    group so that a tile's rows are 64 bytes apart (a row of keys apart they fell into a few
    cache sets); tail: uint16 [16, dim] scratch. Tiles configured by the caller (tile_shapes).

    The value rows go into the tiles as they lie, 16 keys of 32 dims (dims 2i, 2i + 1 a pair),
    and the weights twice, each beside a zero: `even` pairs a key's weight with dim 2i (the sums
    of even dims), `odd` with dim 2i + 1; no value is moved before it is multiplied."""
    rows, dim = acc.shape
    groups = (n + GROUP - 1) // GROUP
    for r in range(seen_rows):
        for g in range(groups):
            _spread(p[r], g * GROUP, even, odd, (g * rows + r) * 16)
    full = n - n % GROUP
    if full < n:
        _last_keys(v, full, n, tail)
    stride, r_block = v.strides[0], block_rows(seen_rows)
    for block in range(0, rows, r_block):
        for dim0 in range(0, dim, 32):
            zero(SUMS_EVEN)
            zero(SUMS_ODD)
            for first in range(0, groups * GROUP, GROUP):
                if dim0 == 0:
                    ask_rows(v, first + AHEAD, GROUP)
                load(WEIGHTS_EVEN, even, first * rows + block * 16, 64)
                load(WEIGHTS_ODD, odd, first * rows + block * 16, 64)
                if first < full:
                    load(VALUES, v, first * (stride // 2) + dim0, stride)
                else:
                    load(VALUES, tail, dim0, 2 * dim)
                dot(SUMS_EVEN, WEIGHTS_EVEN, VALUES)
                dot(SUMS_ODD, WEIGHTS_ODD, VALUES)
            store(SUMS_EVEN, acc, block * dim + dim0, 4 * dim)
            store(SUMS_ODD, acc, block * dim + dim0 + 16, 4 * dim)
        _unpair(acc, block, min(r_block, seen_rows - block))


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
