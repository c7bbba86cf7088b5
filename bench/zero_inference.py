"""The ZeRO-Inference-style baseline: the whole KV cache lives in host memory and attention runs
on the CPU, as DeepSpeed ZeRO-Inference's KV offload does. Each layer sends its query and new K/V
to the host and gets the attention output back; weights stay on the device. Only plain
autoregressive decoding uses it.

Its attention is the project's own multi-threaded kernel over host blocks
(triforce.kernels.cpu.host_attention, the hybrid verify's CPU half), so the baseline is the strongest
version of that design rather than a scalar loop."""
from __future__ import annotations

import torch

from triforce.cache_contract import CacheStep
from triforce.kernels import attention
from triforce.kernels.cpu.host_attention import host_partial
from triforce.kernels.cpu.host_attention import takes as host_attention_takes
from triforce.pinned import HostKVStore

BLOCK_TOKENS = 1024


class HostAttentionKVCache:
    """The KV of every token in a host KV store (token-major blocks of BLOCK_TOKENS, from position 0)."""

    layer_major = False

    def __init__(self, cfg, max_len: int, *, dtype: torch.dtype, device: torch.device | str, batch: int = 1,
                 host_budget_bytes: int | None = None, host_arena=None):
        # pageable: the CPU computes on it, nothing is copied from it to the device (a benchmark
        # may lend it a pinned arena's bytes: the CPU reads them the same)
        self.store = HostKVStore(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, max_len, BLOCK_TOKENS,
                                 first_position=0, dtype=dtype, batch=batch, pin=False, budget_bytes=host_budget_bytes,
                                 arena=host_arena)
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
        return self.store.nbytes

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

    def layer_kv(self, layer: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of k, v [B, Hkv, end, D] of `layer` (the prefill's attention reads them)."""
        parts = [self.store.block_kv(self.store.block(layer, b), min(self.store.block_tokens, end - self.store.block_start(b)))
                 for b in range(-(-end // self.store.block_tokens))]
        return torch.cat([k for k, _ in parts], dim=2), torch.cat([v for _, v in parts], dim=2)


class HostAttentionStep(CacheStep):
    def __init__(self, cache: HostAttentionKVCache, start: int, end: int):
        super().__init__(start, end, torch.arange(start, end, device=cache.device)[None], cache.store.data.shape[0])
        self.cache = cache

    def write(self, layer: int, first: int, k: torch.Tensor, v: torch.Tensor) -> None:
        c = self.cache
        c.store.write(layer, first, k.to("cpu"), v.to("cpu"))
        c.d2h_bytes += k.nbytes + v.nbytes

    def attend_written(self, layer: int, q: torch.Tensor, first: int) -> torch.Tensor:
        c, end = self.cache, first + q.shape[2]
        q_host = q.to("cpu")
        c.d2h_bytes += q.nbytes
        window = c.sliding_windows[layer]
        if q.shape[2] == 1 and window is None and host_attention_takes(c.store.data.dtype):
            bt = c.store.block_tokens
            blocks = list(range(-(-end // bt)))
            out, _ = host_partial(q_host, c.store.data[layer], blocks, [min(bt, end - b * bt) for b in blocks],
                                  scale=c.scale)
        else:  # prefill (the baseline times decoding): torch's vectorised CPU attention
            k, v = c.layer_kv(layer, end)
            out = attention(q_host, k.to(q_host.dtype), v.to(q_host.dtype), scale=c.scale, sliding_window=window)
        out = out.to(device=c.device, dtype=q.dtype)
        c.h2d_bytes += out.nbytes
        return out
