"""Attention of a few queries over a long KV view on the CPU: decoding's other memory stream.

Why: PyTorch's CPU flash kernel reads a decoding step's keys and values at 4-13 GB/s of the ~34
these two cores reach (bench/vs_llamacpp.py), and has only the KV heads (3 for SmolLM2) to spread
over the cores. Here a job is one KV head and one split of SPLIT keys: it reads each key and value
row once for every query row sharing that head (the query heads of a group times the new tokens),
keeps (max, sum of exponentials, weighted values) per row, and the splits are merged by
log-sum-exp, so both cores share even a single head's keys.

Batch-invariant: a row's result does not depend on how many query rows a call has. A row always
sums over whole SPLIT-long blocks (keys it may not see, and slots past the view, count as exact
zeros), and the merge runs over the splits in order without reassociation. With the small-rows
linear kernels this makes a verify of T tokens compute each token exactly as decoding it alone
would, so greedy speculative decoding matches AR token for token in bfloat16 too.

bfloat16 queries, keys, values and results travel as raw bits (numba has no bfloat16), widened
as read and rounded once when written (triforce.kernels.cpu.simd.bf16_bits; on CPUs with AVX512-BF16 the
scores and weighted values take the bits as they are: triforce.kernels.cpu.attention.bf16_scores and
bf16_values; float32, and bfloat16 without that instruction, on CPUs with FMA and AVX2 take
triforce.kernels.cpu.attention.f32_parts, see triforce.kernels.cpu.attention.paths);
on CPUs with AMX tiles bfloat16 head dims that are a multiple of 32 take them instead
(triforce.kernels.cpu.attention.amx_parts: a 5-token verify at 26K keys 1.8x a step, 3.5x before);
scores, softmax and sums are float32, as in PyTorch's CPU kernels for this dtype,
exp 16 lanes at a time (triforce.kernels.cpu.simd.f32_lanes.exp_sum). The kernels index a C-contiguous [heads, rows, dim] block laid over the
view's storage (a view of a cache buffer's first `keys` rows); numba vectorises only such arrays."""
from __future__ import annotations

import numba
import numpy as np
import torch
from numba import prange

from triforce.kernels.cpu.attention.paths import (BF16_FMA, BF16_PAIRS, F32_FMA, WIDEN_AS_LOADED, WIDENED, scores_of,
                                             values_of)
from triforce.kernels.cpu.attention.amx_parts import (CHUNK as AMX_CHUNK, block_rows, scores_amx, tile_shapes,
                                                     turned_queries, values_amx)
from triforce.kernels.cpu.simd.amx import HAS_AMX, configure, release, tile_config
from triforce.kernels.cpu.simd.bf16_bits import bits_of, narrow, to_float32
from triforce.kernels.cpu.simd.bf16_dot import HAS_BF16_DOT
from triforce.kernels.cpu.attention.bf16_values import CHUNK
from triforce.kernels.cpu.attention.f32_parts import fits as f32_fits
from triforce.kernels.cpu.simd.f32_dot import HAS_F32_FMA
from triforce.kernels.cpu.simd.f32_lanes import exp_sum, max_of
from triforce.kernels.cpu.simd.features import host_flags
from triforce.kernels.device_kind import on_host

# torch's CPU flash kernel multiplies bfloat16 on AMX tiles where the CPU has them: there it ran a
# prefill chunk 3.3-3.8x faster than this kernel (332-361 against 92-99 GFLOP/s, 512-1024 new
# tokens over 8K-16K keys, 2-core Xeon, 2026-11-28); without AMX this kernel ran 2.0-2.8x as fast (Zen 4)
SDPA_ON_AMX = "amx_bf16" in host_flags()

SMALL_QUERIES = 16  # beyond this many new tokens a prefill's chunk: prefill_attention where it pays, else SDPA
SPLIT = 512         # keys per job: 3 heads of 2K keys make 12 jobs for 2 cores
# What a prefill chunk's per-split partials may hold at once (prefill_attention): 3072 rows of
# 32 splits (1024 tokens of the default model at 16K) are 75 MB; a larger model's go in pieces.
PREFILL_SCRATCH = 64 << 20
# KV heads x head dim below this (test-sized models) stay on SDPA: a call's fixed cost (~30 us)
# would outweigh its work. A property of the model, never of the context, so a model's AR steps
# and verify passes always take the same kernel.
MIN_KV_WIDTH = 128


@numba.njit(fastmath=True, cache=True)
def _softmax(sc, visible, m_out, l_out):
    """Row r: exponentials of its first visible[r] scores less their max, zeros after (to SPLIT),
    and their (max, sum); the sum always over the whole split, so its grouping never changes. A
    row that sees none of the split gets (-inf, 0)."""
    rows = sc.shape[0]
    for r in range(rows):
        seen = visible[r]
        if seen <= 0:
            sc[r, :] = 0.0
            m_out[r] = -np.inf
            l_out[r] = 0.0
            continue
        m_out[r] = max_of(sc[r], seen)
        l_out[r] = exp_sum(sc[r], seen, m_out[r])


@numba.njit(cache=True)
def _merge(m, l, acc, h, r, out, row):
    """out[h, r] = the splits' weighted values by log-sum-exp, split by split in order (no
    fastmath: the order is what keeps a row's sum the same whatever else the call holds), in
    out's dtype (bfloat16 bits rounded to nearest even, as torch rounds)."""
    splits = m.shape[1]
    dim = row.shape[0]
    top = -np.inf
    for c in range(splits):
        top = max(top, m[h, c, r])
    total = np.float32(0.0)
    row[:] = 0.0
    for c in range(splits):
        if m[h, c, r] == -np.inf:
            continue
        w = np.float32(np.exp(m[h, c, r] - top))
        total += l[h, c, r] * w
        for d in range(dim):
            row[d] += acc[h, c, r, d] * w
    for d in range(dim):
        out[h, r, d] = narrow(row[d] / total, out)


@numba.njit(inline="always")
def _job(job, splits, keys, queries, rows):
    """Job `job`'s KV head, split, first key and key count, and how many of them each query row
    sees (row r = g * queries + t: the new tokens are the view's last ones)."""
    h = job // splits
    c = job - h * splits
    lo = c * SPLIT
    n = min(keys, lo + SPLIT) - lo
    visible = np.empty(rows, np.int64)
    for r in range(rows):
        visible[r] = min(n, keys - queries + r % queries + 1 - lo)
    return h, c, lo, n, visible


@numba.njit(inline="always")
def _attend(q, k, v, scale, keys, queries, out, threads, scores_by, values_by):
    """q [Hkv, R, D] (row r = g * queries + t), k, v [Hkv, >= keys, D], out [Hkv, R, D]: float32,
    or bfloat16 bits, all alike. Row r sees keys s <= keys - queries + t (the new tokens are the
    view's last ones). threads: numba's pool size (per-thread scratch). scores_by, values_by: the
    paths, as literals (inlined into each path's kernel)."""
    heads, rows, dim = q.shape
    splits = (keys + SPLIT - 1) // SPLIT
    q32 = np.empty((heads, rows, dim), np.float32)  # the queries widened and scaled
    for h in range(heads):
        for r in range(rows):
            for d in range(dim):
                q32[h, r, d] = to_float32(q[h, r, d]) * scale
    m = np.empty((heads, splits, rows), np.float32)
    l = np.empty((heads, splits, rows), np.float32)
    acc = np.empty((heads, splits, rows, dim), np.float32)
    scratch_sc = np.empty((threads, rows, SPLIT), np.float32)
    scratch_pairs = np.empty((threads, rows, SPLIT // 2), np.uint32)
    wide = SPLIT if scores_by == BF16_FMA and rows > WIDEN_AS_LOADED else 0
    scratch_wide = np.empty((threads, wide, dim), np.float32)  # keys, then values, widened
    for job in prange(heads * splits):
        h, c, lo, n, visible = _job(job, splits, keys, queries, rows)
        t = numba.get_thread_id()
        sc = scratch_sc[t]
        scores_of(q[h], q32[h], k[h, lo:lo + n], n, scale, sc, scratch_wide[t], scores_by)
        _softmax(sc, visible, m[h, c], l[h, c])
        values_of(sc, v[h, lo:lo + n], n, acc[h, c], np.empty((4, dim), v.dtype), scratch_pairs[t], scratch_wide[t],
                   values_by)
    row = np.empty(dim, np.float32)
    for h in range(heads):
        for r in range(rows):
            _merge(m, l, acc, h, r, out, row)


@numba.njit(parallel=True, cache=True)
def _attend_widened(q, k, v, scale, keys, queries, out, threads):
    _attend(q, k, v, scale, keys, queries, out, threads, WIDENED, WIDENED)


@numba.njit(parallel=True, cache=True)
def _attend_f32_fma(q, k, v, scale, keys, queries, out, threads):
    _attend(q, k, v, scale, keys, queries, out, threads, F32_FMA, F32_FMA)


@numba.njit(parallel=True, cache=True)
def _attend_bf16_fma(q, k, v, scale, keys, queries, out, threads):
    _attend(q, k, v, scale, keys, queries, out, threads, BF16_FMA, BF16_FMA)


@numba.njit(parallel=True, cache=True)
def _attend_bf16_pairs(q, k, v, scale, keys, queries, out, threads):
    _attend(q, k, v, scale, keys, queries, out, threads, BF16_PAIRS, BF16_PAIRS)


@numba.njit(parallel=True, cache=True)
def _attend_bf16_scores(q, k, v, scale, keys, queries, out, threads):
    """Head dims that are a multiple of 32, not of the values' CHUNK: pairs for the scores only."""
    _attend(q, k, v, scale, keys, queries, out, threads, BF16_PAIRS, WIDENED)


@numba.njit(parallel=True, cache=True)
def _attend_amx(q, k, v, scale, keys, queries, out, threads):
    """_attend's contract on AMX tiles (triforce.kernels.cpu.attention.amx_parts): bfloat16 bits, head
    dims a multiple of its CHUNK."""
    heads, rows, dim = q.shape
    splits = (keys + SPLIT - 1) // SPLIT
    r_block = block_rows(rows)
    padded = (rows + r_block - 1) // r_block * r_block
    turned = turned_queries(q, padded)
    m = np.empty((heads, splits, rows), np.float32)
    l = np.empty((heads, splits, rows), np.float32)
    acc = np.empty((heads, splits, rows, dim), np.float32)
    # per thread, a job's tiles' rows (those past `rows` are never read: left as they come)
    scratch_sc = np.empty((threads, padded, SPLIT), np.float32)
    scratch_even = np.empty((threads, padded * SPLIT), np.uint32)
    scratch_odd = np.empty((threads, padded * SPLIT), np.uint32)
    scratch_acc = np.empty((threads, padded, dim), np.float32)
    scratch_scores = np.empty((threads, 16, 16), np.float32)
    scratch_tail = np.empty((threads, 16, dim), np.uint16)
    config = tile_config(tile_shapes(rows))
    for job in prange(heads * splits):
        h, c, lo, n, visible = _job(job, splits, keys, queries, rows)
        t = numba.get_thread_id()
        configure(config)
        scores_amx(turned[h], k[h, lo:lo + n], n, scale, scratch_sc[t], scratch_scores[t], scratch_tail[t], rows)
        _softmax(scratch_sc[t, :rows], visible, m[h, c], l[h, c])
        values_amx(scratch_sc[t], v[h, lo:lo + n], n, rows, scratch_acc[t], scratch_even[t], scratch_odd[t],
                   scratch_tail[t])
        release()
        acc[h, c] = scratch_acc[t, :rows]
    row = np.empty(dim, np.float32)
    for h in range(heads):
        for r in range(rows):
            _merge(m, l, acc, h, r, out, row)


def attend_kernel(dtype: torch.dtype, dim: int):
    """The compiled attention for `dtype` and head dim `dim` on this CPU (see
    triforce.kernels.cpu.attention.paths)."""
    if dtype == torch.bfloat16 and HAS_AMX and dim % AMX_CHUNK == 0:
        return _attend_amx
    if dtype == torch.bfloat16 and HAS_BF16_DOT and dim % 32 == 0:
        return _attend_bf16_pairs if dim % CHUNK == 0 else _attend_bf16_scores
    if HAS_F32_FMA and f32_fits(dim):
        return _attend_f32_fma if dtype == torch.float32 else _attend_bf16_fma
    return _attend_widened


def _whole(t: torch.Tensor):
    """[Hkv, S, D] with rows of D contiguous and heads a whole number of rows apart -> the numpy
    [Hkv, head stride / D, D] block over the same storage (raw bits for bfloat16)."""
    heads, _, dim = t.shape
    block = torch.as_strided(t, (heads, t.stride(0) // dim, dim), (t.stride(0), dim, 1), t.storage_offset())
    return bits_of(block)


def takes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sliding_window: int | None) -> bool:
    """Whether this kernel serves the call: CPU float32 or bfloat16, one sequence, at most
    SMALL_QUERIES new tokens, KV heads x head dim >= MIN_KV_WIDTH, no sliding window that hides
    keys, and k, v laid out as rows of a cache buffer (contiguous rows, heads whole rows apart,
    the block within the storage)."""
    return takes_step(q, k.shape[1], k.shape[2], sliding_window) and _serves(q, k, v)


def takes_step(q: torch.Tensor, kv_heads: int, keys: int, sliding_window: int | None) -> bool:
    """`takes`' conditions on the queries alone: one sequence on the CPU, 1 to SMALL_QUERIES new
    tokens, its heads grouped over kv_heads, no sliding window hiding any of `keys`."""
    return on_host(q) and step_fits(q.shape[0], q.shape[1], q.shape[2], kv_heads, keys, sliding_window)


def step_fits(batch: int, heads: int, tokens: int, kv_heads: int, keys: int, sliding_window: int | None) -> bool:
    """takes_step's conditions on the shapes alone (the queries on the CPU being the caller's to know)."""
    return (0 < tokens <= min(SMALL_QUERIES, keys) and batch == 1 and heads % kv_heads == 0
            and (sliding_window is None or keys <= sliding_window))


def takes_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sliding_window: int | None) -> bool:
    """Whether prefill_attention serves a prefill chunk after the first (more than SMALL_QUERIES
    new tokens after earlier keys): bfloat16 on the CPU's bfloat16 dot, as `takes` otherwise.
    There it ran 2.0-2.8x torch's flash kernel (256 to 1024 new tokens over 8K-16K keys, Zen 4);
    float32 on FMA ran 0.5-1.1x and a first chunk (half its scores masked) 0.8x: those stay on SDPA,
    as every chunk does where torch's kernel has AMX (SDPA_ON_AMX)."""
    dim = q.shape[-1]
    return (q.dtype == torch.bfloat16 and HAS_BF16_DOT and not SDPA_ON_AMX and dim % CHUNK == 0
            and SMALL_QUERIES < q.shape[2] < k.shape[2]
            and _one_grouped_sequence(q, k.shape[1], k.shape[2], sliding_window) and _serves(q, k, v))


def _one_grouped_sequence(q: torch.Tensor, kv_heads: int, keys: int, sliding_window: int | None) -> bool:
    return (on_host(q) and q.shape[0] == 1 and q.shape[1] % kv_heads == 0
            and (sliding_window is None or keys <= sliding_window))


def _serves(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    if q.dtype not in (torch.float32, torch.bfloat16) or k.dtype != q.dtype:
        return False
    if k.shape[1] * k.shape[3] < MIN_KV_WIDTH:
        return False
    return all(_lays_out(t, k.shape) for t in (k, v))


def _lays_out(t: torch.Tensor, shape) -> bool:
    _, heads, keys, dim = shape
    if t.shape != shape or t.stride(3) != 1 or t.stride(2) != dim:
        return False
    head = t.stride(1)
    if head % dim or head < keys * dim:
        return False
    return t.storage_offset() + heads * head <= t.untyped_storage().nbytes() // t.element_size()


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float) -> torch.Tensor:
    """q [1, H, T, D]; k, v [1, Hkv, S, D] (see `takes`): causal, bottom-right aligned (query t
    sees key j iff j <= S - T + t). Returns [1, H, T, D] in q's dtype."""
    return attend_blocks(attend_kernel(q.dtype, q.shape[-1]), q, _whole(k[0]), _whole(v[0]), np.float32(scale),
                         k.shape[2])


def attend_blocks(kernel, q: torch.Tensor, k: np.ndarray, v: np.ndarray, scale: np.float32,
                  keys: int) -> torch.Tensor:
    """q [1, H, T, D] through `kernel` (attend_kernel's) over the first `keys` rows of one layer's
    numpy blocks k, v [Hkv, >= keys, D], causal as in `attention` -> [1, H, T, D] in q's dtype."""
    out = torch.empty(q.shape, dtype=q.dtype, device="cpu")
    attend_arrays(kernel, np.ascontiguousarray(bits_of(q)[0]), k, v, scale, keys, bits_of(out)[0])
    return out


def attend_arrays(kernel, q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: np.float32, keys: int,
                  out: np.ndarray) -> None:
    """attend_blocks on numpy arrays: q and out [H, T, D] C-contiguous (raw bits for bfloat16)."""
    heads, queries, dim = q.shape
    kv_heads = k.shape[0]
    rows = heads // kv_heads * queries  # a KV head's queries: its heads' rows one after the other
    kernel(q.reshape(kv_heads, rows, dim), k, v, scale, keys, queries, out.reshape(kv_heads, rows, dim),
           numba.config.NUMBA_NUM_THREADS)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float) -> torch.Tensor:
    """`attention` for a long chunk (see takes_prefill), its queries in pieces whose per-split
    partials stay within PREFILL_SCRATCH, each piece over the keys up to its last query's. A query
    gets the same bits in any piece (the kernel is batch-invariant)."""
    _, heads, queries, dim = q.shape
    keys = k.shape[2]
    per_query = heads * ((keys + SPLIT - 1) // SPLIT) * dim * 4  # its rows' partials, float32
    piece = max(1, PREFILL_SCRATCH // per_query)
    if piece >= queries:
        return attention(q, k, v, scale=scale)
    out = torch.empty_like(q)
    for first in range(0, queries, piece):
        end = min(queries, first + piece)
        seen = keys - queries + end
        out[:, :, first:end] = attention(q[:, :, first:end], k[:, :, :seen], v[:, :, :seen], scale=scale)
    return out


def taken_dims(dtype: torch.dtype, kv_shapes) -> list[int]:
    """The head dims of the models of `dtype`, given as (KV heads, head dim), whose attention
    this kernel takes."""
    if dtype not in (torch.float32, torch.bfloat16):
        return []
    return sorted({dim for heads, dim in kv_shapes if heads * dim >= MIN_KV_WIDTH})


def warm_up(dtype: torch.dtype, kv_shapes=((2, 64),)) -> None:
    """Compile the kernels for `dtype` and the models' (KV heads, head dim) now (or load them
    from numba's cache), so that the first token of the first answer does not wait for them
    (seconds on a fresh install). Models too narrow for this kernel (MIN_KV_WIDTH) compile nothing."""
    for dim in taken_dims(dtype, kv_shapes):
        k = torch.zeros(1, 2, 8, dim, dtype=dtype, device="cpu")
        attention(torch.zeros(1, 2, 1, dim, dtype=dtype, device="cpu"), k, k, scale=1.0)
