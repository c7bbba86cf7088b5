"""Attention of a pass's queries over host KV blocks, read in place by CPU threads.

Two users: the hybrid full verify (while PCIe streams some of a layer's host blocks to the GPU,
the CPU attends over the others where they lie, and the partial results merge by log-sum-exp as
streamed blocks do) and the ZeRO-Inference-style baseline (all KV on the host, attention on the
CPU). Every host block precedes the pass's new tokens, so each query sees all of a block's keys
(the caller keeps sliding windows off this path).

A job is one (KV head, block): it reads each key and value row of the block once for every query
row sharing that head (the group's query heads times the new tokens) and keeps (max, sum of
exponentials, weighted values) per row; the jobs of a head merge in block order. Blocks are
token-major ([tokens, 2 (K, V), B, Hkv, D], the host store's layout), so a key row is D
contiguous elements of the store: the FMA path (float32, or bfloat16 bits widened as loaded, on
CPUs with FMA and head dims triforce.kernels.cpu.attention.f32_parts fits) runs the decode
kernels' scores and weighted values on them in place (f32_parts.key_row); the plain path (float64,
other CPUs and head dims) is numba loops. Float32 arithmetic, float64 for a float64 store."""
from __future__ import annotations

import math

import numba
import numpy as np
import torch
from numba import prange, types
from numba.extending import overload

from triforce.kernels.cpu.simd.bf16_bits import to_float32
from triforce.kernels.cpu.attention.f32_parts import fits as fma_fits
from triforce.kernels.cpu.attention.f32_parts import scores_f32_fma, values_f32_fma
from triforce.kernels.cpu.simd.f32_dot import HAS_F32_FMA
from triforce.kernels.cpu.simd.f32_lanes import exp_sum, max_of


def as_float(x):
    raise NotImplementedError("numba only: see the overload")


@overload(as_float)
def _as_float(x):
    """A value of the store as arithmetic reads it: bfloat16 bits widened, floats as they are."""
    if x == types.uint16:
        return lambda x: to_float32(x)
    if isinstance(x, types.Float):
        return lambda x: x
    return None


# nogil: the hybrid verify runs these on a worker thread while the main thread launches the
# device's work for the same layer
@numba.njit(parallel=True, cache=True, nogil=True)
def _partials_fma(q, data, b, blocks, counts, m, l, acc, threads):
    """q [Hkv, R, D] float32 (scaled); data [num_blocks, bt, 2, B, Hkv, D] float32 or bfloat16
    bits; job (h, j): m, l [Hkv, J, R] and acc [Hkv, J, R, D] of block blocks[j]'s first
    counts[j] keys, by the decode kernels' scores and weighted values (the same bits as a
    decoding step's job over those keys)."""
    heads, rows, dim = q.shape
    jobs = blocks.shape[0]
    scratch = np.empty((threads, rows, data.shape[1]), np.float32)
    for job in prange(heads * jobs):
        h = job // jobs
        j = job - h * jobs
        block, n = blocks[j], counts[j]
        sc = scratch[numba.get_thread_id()]
        scores_f32_fma(q[h], (data[block], 0, b, h), n, sc)
        for r in range(rows):
            m[h, j, r] = max_of(sc[r], n)
            l[h, j, r] = exp_sum(sc[r], n, m[h, j, r])
        values_f32_fma(sc, (data[block], 1, b, h), n, acc[h, j])


@numba.njit(parallel=True, fastmath=True, cache=True, nogil=True)
def _partials_plain(q, data, b, blocks, counts, m, l, acc, threads):
    """As _partials_fma with numba's own loops (q and the accumulators in the store's float
    type; bfloat16 bits widened as read)."""
    heads, rows, dim = q.shape
    jobs = blocks.shape[0]
    scratch = np.empty((threads, rows, data.shape[1]), q.dtype)
    for job in prange(heads * jobs):
        h = job // jobs
        j = job - h * jobs
        block, n = blocks[j], counts[j]
        sc = scratch[numba.get_thread_id()]
        for s in range(n):
            for r in range(rows):
                total = q[h, r, 0] * 0  # zero in q's float type
                for d in range(dim):
                    total += q[h, r, d] * as_float(data[block, s, 0, b, h, d])
                sc[r, s] = total
        for r in range(rows):
            top = -np.inf
            for s in range(n):
                top = max(top, sc[r, s])
            total = q[h, r, 0] * 0
            for s in range(n):
                p = math.exp(sc[r, s] - top)
                sc[r, s] = p
                total += p
            m[h, j, r] = top
            l[h, j, r] = total
        acc[h, j] = 0.0
        for s in range(n):
            for r in range(rows):
                p = sc[r, s]
                for d in range(dim):
                    acc[h, j, r, d] += p * as_float(data[block, s, 1, b, h, d])


@numba.njit(cache=True, nogil=True)
def _merge(m, l, acc, out, lse):
    """out [Hkv, R, D], lse [Hkv, R]: the jobs of each head merged in block order."""
    heads, jobs, rows = m.shape
    for h in range(heads):
        for r in range(rows):
            top = -np.inf
            for j in range(jobs):
                top = max(top, m[h, j, r])
            total = 0.0
            out[h, r, :] = 0.0
            for j in range(jobs):
                if m[h, j, r] == -np.inf:
                    continue
                w = math.exp(m[h, j, r] - top)
                total += l[h, j, r] * w
                for d in range(out.shape[2]):
                    out[h, r, d] += acc[h, j, r, d] * w
            for d in range(out.shape[2]):
                out[h, r, d] /= total
            lse[h, r] = top + math.log(total)


def _raw(data: torch.Tensor) -> np.ndarray:
    """The store's bytes as numba reads them: bfloat16 as raw bits, float32/float64 as they are."""
    if data.dtype == torch.bfloat16:
        return data.view(torch.int16).numpy().view(np.uint16)
    if data.dtype in (torch.float32, torch.float64):
        return data.numpy()
    raise TypeError(f"host attention reads float32, float64 or bfloat16 KV, not {data.dtype}")


def takes(dtype: torch.dtype) -> bool:
    """Whether host KV of `dtype` can be attended in place (else it is streamed)."""
    return dtype in (torch.float32, torch.float64, torch.bfloat16)


def host_partial(q: torch.Tensor, data: torch.Tensor, blocks: list[int], counts: list[int], *,
                 scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, H, T, D] (CPU, any float dtype); data: one layer of the host store, [num_blocks,
    block_tokens, 2, B, Hkv, D] (float32, float64 or bfloat16); blocks: the block indices to
    attend over, counts: how many of each block's first tokens hold keys. Returns
    (out [B, H, T, D], lse [B, H, T]) in float32 (float64 for a float64 store), every query
    seeing every key given."""
    if not blocks or len(blocks) != len(counts) or min(counts) < 1 or max(counts) > data.shape[1]:
        raise ValueError(f"host_partial needs blocks with 1..{data.shape[1]} keys each, got {counts}")
    if not data.is_contiguous():
        raise ValueError("host_partial reads the host store's contiguous blocks")
    batch, heads, queries, dim = q.shape
    kv_heads = data.shape[4]
    rows = heads // kv_heads * queries
    calc = torch.float64 if data.dtype == torch.float64 else torch.float32
    np_calc = np.float64 if calc == torch.float64 else np.float32
    raw = _raw(data)
    fast = calc == torch.float32 and HAS_F32_FMA and fma_fits(dim)
    block_index = np.asarray(blocks, np.int64)
    count_index = np.asarray(counts, np.int64)
    out = np.empty((batch, kv_heads, rows, dim), np_calc)
    lse = np.empty((batch, kv_heads, rows), np_calc)
    m = np.empty((kv_heads, len(blocks), rows), np_calc)
    l = np.empty((kv_heads, len(blocks), rows), np_calc)
    acc = np.empty((kv_heads, len(blocks), rows, dim), np_calc)
    # row r of KV head h: query head h * group + r // queries, new token r % queries
    q_rows = (q.to(calc) * scale).reshape(batch, kv_heads, rows, dim).contiguous().numpy()
    partials = _partials_fma if fast else _partials_plain
    for b in range(batch):
        partials(q_rows[b], raw, b, block_index, count_index, m, l, acc, numba.config.NUMBA_NUM_THREADS)
        _merge(m, l, acc, out[b], lse[b])
    return (torch.from_numpy(out).view(batch, heads, queries, dim),
            torch.from_numpy(lse).view(batch, heads, queries))


def warm_up(dtype: torch.dtype, kv_heads: int, dim: int) -> None:
    """Compile (or load from numba's cache) the kernel a store of `dtype` and these heads takes,
    before the first pass that needs it (seconds on a fresh install)."""
    if takes(dtype):
        data = torch.zeros(1, 4, 2, 1, kv_heads, dim, dtype=dtype)
        host_partial(torch.zeros(1, kv_heads, 1, dim, dtype=dtype), data, [0], [4], scale=1.0)
