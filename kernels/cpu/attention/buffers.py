"""A decoding step's KV write and attention straight over one cache's CPU buffers.

Why: the kernel of triforce.kernels.cpu.attention.decode takes torch views, and each layer of a
step paid for them in Python: two slices of each buffer, the checks of `decode.takes`, two numpy
blocks over the storage and a torch copy of the new keys and values: 12-13 ms of the default
model's 2K token where the kernel took ~10 (2-core Zen 3, bench/RESULTS.md "buffer decoder"). Here
the numpy blocks and the kernel are taken once per cache; a step writes its rows with numpy and
calls the same kernel on the same arrays, so its results are the same bits."""
from __future__ import annotations

import numpy as np
import torch

from triforce.kernels.cpu.attention.decode import MIN_KV_WIDTH, attend_arrays, attend_blocks, attend_kernel, step_fits
from triforce.kernels.cpu.simd.bf16_bits import bits_of
from triforce.kernels.device_kind import on_host


class BufferDecoder:
    """Decoding steps over k_buf, v_buf [L, 1, Hkv, capacity, D] (float32 or bfloat16, contiguous,
    on the CPU): `serves` says which calls it takes, `write` and `attend` do them."""

    @staticmethod
    def over(k_buf: torch.Tensor, v_buf: torch.Tensor, scale: float) -> BufferDecoder | None:
        """The decoder for these buffers, or None where the kernel does not take them (another
        device or dtype, a batch of sequences, a model too narrow for it)."""
        fits = (on_host(k_buf) and k_buf.dtype in (torch.float32, torch.bfloat16) and k_buf.dim() == 5
                and k_buf.shape[1] == 1 and k_buf.shape[2] * k_buf.shape[4] >= MIN_KV_WIDTH
                and v_buf.shape == k_buf.shape and v_buf.dtype == k_buf.dtype and on_host(v_buf)
                and k_buf.is_contiguous() and v_buf.is_contiguous())
        return BufferDecoder(k_buf, v_buf, scale) if fits else None

    def __init__(self, k_buf: torch.Tensor, v_buf: torch.Tensor, scale: float):
        self.dtype, self.kv_heads = k_buf.dtype, k_buf.shape[2]
        self.k, self.v = bits_of(k_buf)[:, 0], bits_of(v_buf)[:, 0]  # [L, Hkv, capacity, D] over the storage
        self.scale = np.float32(scale)
        self.kernel = attend_kernel(self.dtype, k_buf.shape[4])

    def takes_rows(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
        """Whether new q, k, v [1, H or Hkv, T, D] are rows `write` copies as they are and `attend`
        reads: on the CPU, all three in one dtype (serves_step says the rest)."""
        return q.dtype == k.dtype == v.dtype and on_host(q)

    def serves_step(self, dtype: torch.dtype, batch: int, heads: int, tokens: int, keys: int,
                    window: int | None) -> bool:
        """Whether this kernel takes a step of `tokens` new rows in `dtype` (on the CPU) seeing
        `keys` slots: decode.takes' conditions on the queries (its others held for these buffers
        when they were taken), the rows in the buffers' dtype."""
        return dtype == self.dtype and step_fits(batch, heads, tokens, self.kv_heads, keys, window)

    def write(self, layer: int, first: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [1, Hkv, T, D] into slots [first, first + T) of `layer`."""
        end = first + k.shape[2]
        self.k[layer, :, first:end] = bits_of(k)[0]
        self.v[layer, :, first:end] = bits_of(v)[0]

    def attend(self, layer: int, q: torch.Tensor, keys: int) -> torch.Tensor:
        """q [1, H, T, D] over `layer`'s first `keys` slots (query t sees slot j iff
        j <= keys - T + t) -> [1, H, T, D] in q's dtype."""
        return attend_blocks(self.kernel, q, self.k[layer], self.v[layer], self.scale, keys)

    def attend_rows(self, layer: int, q: np.ndarray, keys: int) -> np.ndarray:
        """`attend` on numpy arrays: q [H, T, D] C-contiguous in the buffers' numpy dtype (raw bits
        for bfloat16) -> [H, T, D] of the same."""
        out = np.empty_like(q)
        attend_arrays(self.kernel, q, self.k[layer], self.v[layer], self.scale, keys, out)
        return out
