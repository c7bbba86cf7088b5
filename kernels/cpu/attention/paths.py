"""How an attention job (one KV head, one split of keys) scores its keys and weighs their values,
for triforce.kernels.cpu.attention.decode: the arithmetic is fixed by the dtype, the CPU and the head dim
(never by the rows), so a verify pass computes each token as decoding it alone would.

The widened path is numba's own loops (bfloat16 bits widened as read, sums left to LLVM's
vectoriser); the others are the AVX512-BF16 pairs (bf16_scores, bf16_values) and the FMA
vectors (f32_attention_parts), for float32 keys or bfloat16 ones widened first."""
from __future__ import annotations

import numba
import numpy as np
from numba import types
from numba.extending import overload

from triforce.kernels.cpu.simd.bf16_bits import to_float32
from triforce.kernels.cpu.attention.bf16_scores import scores_bf16_pairs
from triforce.kernels.cpu.attention.bf16_values import values_bf16_pairs
from triforce.kernels.cpu.attention.f32_parts import scores_f32_fma, values_f32_fma


@numba.njit(fastmath=True, cache=True)
def scores_widened(q, k, n, out):
    """out[r, s] = q[r] . k[s] for s < n (k float32 or bfloat16 bits)."""
    rows, dim = q.shape
    for s in range(n):
        for r in range(rows):
            a = np.float32(0.0)
            for d in range(dim):
                a += q[r, d] * to_float32(k[s, d])
            out[r, s] = a


# How a job scores its keys and weighs their values, fixed by the dtype, the CPU and the head dim
# (never by the rows): each path is a kernel of its own (see attend_kernel), so a model compiles
# only the code it runs. With both paths in one kernel (a branch on the head dim) a float32 model
# on an FMA CPU compiled the widening ones too: 17-18 s for the attention kernel instead of 8 on
# a 2-core Zen 3.
# BF16_FMA: bfloat16 on a CPU with FMA but no bfloat16 dot: a job's keys and values are widened
# once into float32 scratch, then F32_FMA's kernels (the same bits as float32 copies would give;
# widening as loaded would redo it for every query row: 27 rows x 512 keys, scores 67 -> 42 us).
WIDENED, F32_FMA, BF16_PAIRS, BF16_FMA = 0, 1, 2, 3
# Up to this many query rows BF16_FMA widens keys and values as loaded instead (the same bits):
# a decoding step's few rows read each key once or twice, and the scratch's round trip cost more.
# The caller decides once, by the size of the scratch it hands over (no rows: widen as loaded).
WIDEN_AS_LOADED = 4


@numba.njit(inline="always")
def _widen(src, n, dst):
    """dst[:n] = src[:n] as float32 (bfloat16 bits widened: exact)."""
    for s in range(n):
        for d in range(src.shape[1]):
            dst[s, d] = to_float32(src[s, d])
    return dst


def scores_of(q, q32, k, n, scale, out, wide, path):
    raise NotImplementedError("numba only: see the overload")


@overload(scores_of, prefer_literal=True)
def _scores_for(q, q32, k, n, scale, out, wide, path):
    """bfloat16 on a CPU with the bfloat16 dot instruction scores the raw bits q (then scales),
    float32 on a CPU with FMA goes through f32_attention_parts (bfloat16 keys widened into `wide`
    first), all else the widened, pre-scaled q32."""
    if not isinstance(path, types.IntegerLiteral):
        return None
    if path.literal_value == BF16_PAIRS:
        return lambda q, q32, k, n, scale, out, wide, path: scores_bf16_pairs(q, k, n, scale, out)
    if path.literal_value == F32_FMA:
        return lambda q, q32, k, n, scale, out, wide, path: scores_f32_fma(q32, k, n, out)
    if path.literal_value == BF16_FMA:
        def widened_first(q, q32, k, n, scale, out, wide, path):
            if wide.shape[0] == 0:
                scores_f32_fma(q32, k, n, out)
            else:
                scores_f32_fma(q32, _widen(k, n, wide), n, out)
        return widened_first
    return lambda q, q32, k, n, scale, out, wide, path: scores_widened(q32, k, n, out)


def values_of(p, v, n, acc, pad, weights, wide, path):
    raise NotImplementedError("numba only: see the overload")


@overload(values_of, prefer_literal=True)
def _values_for(p, v, n, acc, pad, weights, wide, path):
    """As _scores_for: bfloat16 values on the dot instruction (weights rounded to bfloat16, as
    PyTorch's CPU attention rounds them), or widened into `wide` for the FMA kernel, all else
    widened as read."""
    if not isinstance(path, types.IntegerLiteral):
        return None
    if path.literal_value == BF16_PAIRS:
        return lambda p, v, n, acc, pad, weights, wide, path: values_bf16_pairs(p, v, n, acc, pad, weights)
    if path.literal_value == F32_FMA:
        return lambda p, v, n, acc, pad, weights, wide, path: values_f32_fma(p, v, n, acc)
    if path.literal_value == BF16_FMA:
        def widened_first(p, v, n, acc, pad, weights, wide, path):
            if wide.shape[0] == 0:
                values_f32_fma(p, v, n, acc)
            else:
                values_f32_fma(p, _widen(v, n, wide), n, acc)
        return widened_first
    return lambda p, v, n, acc, pad, weights, wide, path: values_widened(p, v, n, acc, pad)


@numba.njit(fastmath=True, cache=True)
def values_widened(p, v, n, acc, pad):
    """acc[r] = sum over s of p[r, s] * v[s], keys four at a time (each group's weighted rows
    summed, then added: a quarter of the accumulator traffic). Groups start at multiples of 4;
    the last, partial one is read from `pad` (its rows, then zero rows) through the same loop, so
    a row's sum never depends on n (hidden keys weigh an exact 0 too)."""
    rows, dim = acc.shape
    acc[:, :] = 0.0
    for g in range(0, n, 4):
        src, base = v, g
        if g + 4 > n:
            pad[:, :] = 0
            pad[:n - g] = v[g:n]
            src, base = pad, 0
        for r in range(rows):
            w0, w1, w2, w3 = p[r, g], p[r, g + 1], p[r, g + 2], p[r, g + 3]
            for d in range(dim):
                acc[r, d] += (w0 * to_float32(src[base, d]) + w1 * to_float32(src[base + 1, d])
                              + w2 * to_float32(src[base + 2, d]) + w3 * to_float32(src[base + 3, d]))
