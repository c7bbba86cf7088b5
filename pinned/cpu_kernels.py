"""Parallel numba kernels over host-resident KV: gathering selected tokens into a staging
buffer (attention over host KV in place is triforce.kernels.cpu.attention.host).

numba has no bfloat16 or float16, so 16-bit tensors travel as raw bits (uint16) and are widened
to float32 inside the kernels; float32 and float64 are read directly."""
from __future__ import annotations

import numba
import numpy as np
import torch
from numba import prange

_RAW_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


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
