"""Full KV cache storage: preallocated per-layer K/V with append and rollback.

Every cache in triforce hands the model a per-forward *step* object with `positions` (the RoPE
positions of the new tokens) and `attend(layer, q, k, v)`; the caches differ only in what they
keep. Keys are stored after RoPE, so an entry keeps its position wherever it is copied."""
from __future__ import annotations

import torch

from triforce.config import ModelConfig
from triforce.errors import UserError
from triforce.kernels import attention


class FullKVCache:
    """Keys and values of every token so far, for every layer.

    k_buf, v_buf: [num_layers, B, Hkv, max_len, D]. Entries [0, length) are valid."""

    def __init__(self, cfg: ModelConfig, max_len: int, *, batch: int = 1,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        shape = (cfg.num_layers, batch, cfg.num_kv_heads, max_len, cfg.head_dim)
        self.k_buf = torch.zeros(shape, dtype=dtype, device=device)
        self.v_buf = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len
        self.length = 0
        self.scale = cfg.head_dim ** -0.5
        self.sliding_windows = cfg.sliding_windows

    @property
    def nbytes(self) -> int:
        return self.k_buf.nbytes + self.v_buf.nbytes

    def step(self, num_new: int, record_queries: bool = False) -> "FullCacheStep":
        """Reserve slots for `num_new` tokens and return the view one forward pass writes into.
        With record_queries, the step keeps each layer's post-RoPE queries (for retrieval)."""
        if self.length + num_new > self.max_len:
            raise UserError(f"context full: {self.length} + {num_new} tokens exceed the cache's "
                            f"{self.max_len} slots")
        start = self.length
        self.length += num_new
        return FullCacheStep(self, start, self.length, record_queries)

    def rollback(self, length: int) -> None:
        """Forget every entry at index >= length (rejected speculative tokens, an aborted step)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot roll back to {length}: cache holds {self.length}")
        self.length = length

    def keys(self, layer: int) -> torch.Tensor:
        return self.k_buf[layer, :, :, :self.length]

    def values(self, layer: int) -> torch.Tensor:
        return self.v_buf[layer, :, :, :self.length]


class FullCacheStep:
    """Writes one forward pass's new K/V into slots [start, end) and attends over [0, end)."""

    def __init__(self, cache: FullKVCache, start: int, end: int, record_queries: bool):
        self.cache, self.start, self.end = cache, start, end
        self.positions = torch.arange(start, end, device=cache.k_buf.device)[None]
        self.queries: list[torch.Tensor] | None = [] if record_queries else None  # per layer [B, H, T, D]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        c = self.cache
        c.k_buf[layer, :, :, self.start:self.end] = k
        c.v_buf[layer, :, :, self.start:self.end] = v
        if self.queries is not None:
            self.queries.append(q)
        return attention(q, c.k_buf[layer, :, :, :self.end], c.v_buf[layer, :, :, :self.end],
                         scale=c.scale, sliding_window=c.sliding_windows[layer])
