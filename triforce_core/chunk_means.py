"""Mean keys of complete retrieval chunks, kept per layer and extended only by the chunks
completed since the last read, so a rebuild never recomputes them over the whole context."""
from __future__ import annotations

from typing import Callable

import torch

from triforce.kernels import chunk_mean_keys


class ChunkMeans:
    """means_buf: [L, B, Hkv, max_chunks, D]; chunks [0, valid[layer]) of a layer are current."""

    def __init__(self, num_layers: int, batch: int, kv_heads: int, max_chunks: int, head_dim: int,
                 chunk_size: int, *, dtype: torch.dtype, device: torch.device | str):
        self.chunk_size = chunk_size
        self.means_buf = torch.zeros(num_layers, batch, kv_heads, max_chunks, head_dim, dtype=dtype, device=device)
        self.valid = [0] * num_layers

    @property
    def nbytes(self) -> int:
        return self.means_buf.nbytes

    def read(self, layer: int, count: int, keys: Callable[[int, int], torch.Tensor]) -> torch.Tensor:
        """Means [B, Hkv, count, D] of the first `count` chunks; keys(start, end) returns the
        layer's keys [B, Hkv, end - start, D] of tokens [start, end) for chunks not yet averaged."""
        done = self.valid[layer]
        if done < count:
            cs = self.chunk_size
            self.means_buf[layer, :, :, done:count] = chunk_mean_keys(keys(done * cs, count * cs), cs)
            self.valid[layer] = count
        return self.means_buf[layer, :, :, :count]

    def rollback(self, length: int) -> None:
        """Tokens from `length` on are gone: drop the chunks they completed."""
        complete = length // self.chunk_size
        self.valid = [min(v, complete) for v in self.valid]
