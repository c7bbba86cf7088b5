"""Parallel numba kernels over host-resident KV: gathering selected tokens into a staging
buffer, and attention computed on the CPU (the ZeRO-Inference-style baseline).

numba has no bfloat16 or float16, so 16-bit tensors travel as raw bits (uint16) and are widened
to float32 inside the kernels; float32 and float64 are read directly."""
from __future__ import annotations

import math

import numba
import numpy as np
import torch
from numba import prange

_RAW_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
KIND_FLOAT, KIND_BF16, KIND_FP16 = 0, 1, 2


def _raw(t: torch.Tensor) -> np.ndarray:
    """Same bytes as an integer numpy array (a pure copy needs no arithmetic on the values)."""
    return t.view(_RAW_INT[t.element_size()]).numpy()


@numba.njit(parallel=True, cache=True)
def _gather_blocked(src, index, base, out_k, out_v):
    rows, count = index.shape
    num_blocks, block = src.shape[0], src.shape[1]
    for job in prange(rows * count):
        r = job // count
        j = job - r * count
        i = index[r, j] - base
        if 0 <= i < num_blocks * block:
            b = i // block
            o = i - b * block
            out_k[r, j, :] = src[b, o, 0, r, :]
            out_v[r, j, :] = src[b, o, 1, r, :]


def gather_blocked(src: torch.Tensor, index: torch.Tensor, base: int, out_k: torch.Tensor,
                   out_v: torch.Tensor) -> None:
    """Gather tokens from one layer of the host store into a staging buffer.

    src: [num_blocks, block, 2 (K, V), B, Hkv, D] host tensor (token-major blocks), slot i =
    position base + i;
    index: [B, Hkv, N] int64 positions (CPU); out_k, out_v: [B, Hkv, N, D] host tensors of src's
    dtype. out[b, h, n] = the K (V) of position index[b, h, n] where the store holds it; other
    entries are left untouched."""
    if src.dtype != out_k.dtype or src.dtype != out_v.dtype:
        raise TypeError(f"gather from {src.dtype} into {out_k.dtype}/{out_v.dtype}")
    if not (src.is_contiguous() and out_k.is_contiguous() and out_v.is_contiguous()):
        raise ValueError("gather_blocked needs contiguous tensors (it writes through numpy views)")
    num_blocks, block, _, batch, heads, dim = src.shape
    rows = batch * heads
    src_rows = _raw(src).reshape(num_blocks, block, 2, rows, dim)
    idx = index.to(torch.int64).contiguous().numpy().reshape(rows, index.shape[2])
    _gather_blocked(src_rows, idx, base, _raw(out_k).reshape(rows, -1, dim), _raw(out_v).reshape(rows, -1, dim))


@numba.njit(inline="always")
def _half_to_float(bits):
    sign = -1.0 if bits & 0x8000 else 1.0
    exponent = (bits >> 10) & 0x1F
    mantissa = bits & 0x3FF
    if exponent == 0:
        return sign * mantissa * 2.0 ** -24
    if exponent == 31:
        return sign * np.inf if mantissa == 0 else np.nan
    return sign * (1.0 + mantissa / 1024.0) * 2.0 ** (exponent - 15)


@numba.njit(inline="always")
def _widen_row(src, kind, bits, wide, out):
    """out[:] = src widened (bits, wide: per-thread scratch; wide is bits viewed as float32)."""
    if kind == 1:
        for d in range(src.shape[0]):
            bits[d] = np.uint32(src[d]) << 16
        out[:] = wide
    elif kind == 2:
        for d in range(src.shape[0]):
            out[d] = _half_to_float(np.uint32(src[d]))
    else:
        for d in range(src.shape[0]):
            out[d] = src[d]


@numba.njit(parallel=True, cache=True)
def _attention_rows(q, k, v, kind, groups, scale, q_start, num_keys, window, out):
    heads, num_queries, dim = q.shape
    for job in prange(heads * num_queries):
        h = job // num_queries
        t = job - h * num_queries
        kh = h // groups
        pos = q_start + t
        last = min(pos, num_keys - 1)
        first = 0 if window <= 0 else max(0, pos - window + 1)
        bits = np.empty(dim, np.uint32)
        wide = bits.view(np.float32)
        krow = np.empty(dim, out.dtype)
        vrow = np.empty(dim, out.dtype)
        acc = np.zeros(dim, np.float64)
        running_max = -np.inf
        total = 0.0
        for s in range(first, last + 1):
            _widen_row(k[kh, s], kind, bits, wide, krow)
            score = 0.0
            for d in range(dim):
                score += q[h, t, d] * krow[d]
            score *= scale
            if score > running_max:
                shrink = math.exp(running_max - score)
                total *= shrink
                for d in range(dim):
                    acc[d] *= shrink
                running_max = score
            p = math.exp(score - running_max)
            total += p
            _widen_row(v[kh, s], kind, bits, wide, vrow)
            for d in range(dim):
                acc[d] += p * vrow[d]
        for d in range(dim):
            out[h, t, d] = acc[d] / total if total > 0 else 0.0


def cpu_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, q_start: int,
                  num_keys: int, sliding_window: int | None = None) -> torch.Tensor:
    """Causal attention on the CPU of queries at positions q_start.. over host keys [0, num_keys).

    q: [B, H, T, D] CPU; k, v: [B, Hkv, S >= num_keys, D] host tensors (any float dtype).
    Returns [B, H, T, D] float32 (float64 for float64 keys); the kernel accumulates in float64."""
    batch, heads, num_queries, dim = q.shape
    kv_heads = k.shape[1]
    if k.dtype == torch.bfloat16:
        kind, k_np, v_np = KIND_BF16, k.view(torch.int16).numpy().view(np.uint16), v.view(torch.int16).numpy().view(np.uint16)
    elif k.dtype == torch.float16:
        kind, k_np, v_np = KIND_FP16, k.view(torch.int16).numpy().view(np.uint16), v.view(torch.int16).numpy().view(np.uint16)
    else:
        kind, k_np, v_np = KIND_FLOAT, k.numpy(), v.numpy()
    calc = torch.float64 if k.dtype == torch.float64 else torch.float32
    out = np.empty((batch, heads, num_queries, dim), np.float64 if calc == torch.float64 else np.float32)
    q_np = q.to(calc).contiguous().numpy()
    for b in range(batch):
        _attention_rows(q_np[b], k_np[b], v_np[b], kind, heads // kv_heads, scale, q_start, num_keys,
                        sliding_window or 0, out[b])
    return torch.from_numpy(out)
