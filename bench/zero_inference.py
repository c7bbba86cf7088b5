"""The ZeRO-Inference-style baseline: the whole KV cache lives in host memory and attention runs
on the CPU (a parallel numba kernel), as DeepSpeed ZeRO-Inference's KV offload does. Each layer
sends its query and new K/V to the host and gets the attention output back; weights stay on the
device. Only plain autoregressive decoding uses it."""
from __future__ import annotations

import torch

from triforce.cache_contract import CacheStep
from triforce.kernels import attention
from triforce.pinned import allocate_host, cpu_attention


class HostAttentionKVCache:
    """k_host, v_host: [num_layers, B, Hkv, max_len, D] in (pinned) host memory."""

    layer_major = False

    def __init__(self, cfg, max_len: int, *, dtype: torch.dtype, device: torch.device | str, batch: int = 1,
                 host_budget_bytes: int | None = None):
        shape = (cfg.num_layers, batch, cfg.num_kv_heads, max_len, cfg.head_dim)
        # pageable: the CPU computes on it, nothing is copied from it to the device
        self.k_host, self.v_host = allocate_host([shape, shape], dtype, pin=False, budget_bytes=host_budget_bytes,
                                                 what="the host KV cache")
        self.device = torch.device(device)
        self.max_len, self.length = max_len, 0
        self.scale = cfg.head_dim ** -0.5
        self.sliding_windows = cfg.sliding_windows
        self.h2d_bytes = self.d2h_bytes = 0

    @property
    def nbytes(self) -> int:
        return 0  # nothing of the cache is on the device

    @property
    def host_nbytes(self) -> int:
        return self.k_host.nbytes + self.v_host.nbytes

    def step(self, num_new: int, record_queries: bool = False, prefill: bool = False) -> "HostAttentionStep":
        if record_queries:
            raise ValueError("the ZeRO-Inference baseline runs plain autoregressive decoding only")
        if self.length + num_new > self.max_len:
            raise ValueError(f"context full: {self.length} + {num_new} tokens exceed {self.max_len}")
        start = self.length
        self.length += num_new
        return HostAttentionStep(self, start, self.length)

    def rollback(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot roll back to {length}: cache holds {self.length}")
        self.length = length

    def prepare_verify(self) -> None:
        """Nothing to prefetch: attention runs where the KV is."""


class HostAttentionStep(CacheStep):
    def __init__(self, cache: HostAttentionKVCache, start: int, end: int):
        super().__init__(start, end, torch.arange(start, end, device=cache.device)[None], cache.k_host.shape[0])
        self.cache = cache

    def write(self, layer: int, first: int, k: torch.Tensor, v: torch.Tensor) -> None:
        c = self.cache
        c.k_host[layer, :, :, first:first + k.shape[2]] = k.to("cpu")
        c.v_host[layer, :, :, first:first + v.shape[2]] = v.to("cpu")
        c.d2h_bytes += k.nbytes + v.nbytes

    def attend_written(self, layer: int, q: torch.Tensor, first: int) -> torch.Tensor:
        c, end = self.cache, first + q.shape[2]
        q_host = q.to("cpu")
        c.d2h_bytes += q.nbytes
        window = c.sliding_windows[layer]
        if q.shape[2] > 1:  # prefill: torch's vectorised CPU attention (the baseline times decoding)
            out = attention(q_host, c.k_host[layer, :, :, :end], c.v_host[layer, :, :, :end],
                            scale=c.scale, sliding_window=window)
        else:
            out = cpu_attention(q_host, c.k_host[layer], c.v_host[layer], scale=c.scale, q_start=first,
                                num_keys=end, sliding_window=window)
        out = out.to(device=c.device, dtype=q.dtype)
        c.h2d_bytes += out.nbytes
        return out
