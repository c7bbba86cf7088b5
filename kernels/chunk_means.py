"""Mean keys of complete retrieval chunks, kept per layer and extended only by the chunks
completed since the last read, so a rebuild never recomputes them over the whole context."""
from __future__ import annotations

from typing import Callable

import torch

from triforce.kernels.retrieval import chunk_mean_keys

READ_TOKENS = 4096  # keys averaged per piece: bounds the temporary a long first read makes


class ChunkMeans:
    """means_buf: [L, B, Hkv, max_chunks, D] (device or host); chunks [0, valid[layer]) of a layer
    are current."""

    def __init__(self, means_buf: torch.Tensor, chunk_size: int):
        self.means_buf, self.chunk_size = means_buf, chunk_size
        self.valid = [0] * means_buf.shape[0]

    @classmethod
    def like(cls, k_buf: torch.Tensor, chunk_size: int) -> ChunkMeans:
        """For keys k_buf [L, B, Hkv, S, D]: a buffer of S // chunk_size means beside them."""
        layers, batch, kv_heads, length, dim = k_buf.shape
        means_buf = torch.zeros(layers, batch, kv_heads, length // chunk_size, dim, dtype=k_buf.dtype,
                                device=k_buf.device)
        return cls(means_buf, chunk_size)

    @property
    def nbytes(self) -> int:
        return self.means_buf.nbytes

    def read(self, layer: int, count: int, keys: Callable[[int, int], torch.Tensor]) -> torch.Tensor:
        """Means [B, Hkv, count, D] of the first `count` chunks; keys(start, end) returns the
        layer's keys [B, Hkv, end - start, D] of tokens [start, end) for chunks not yet averaged."""
        cs = self.chunk_size
        piece = max(1, READ_TOKENS // cs)  # chunks per piece
        for first in range(self.valid[layer], count, piece):
            last = min(count, first + piece)
            self.means_buf[layer, :, :, first:last] = chunk_mean_keys(keys(first * cs, last * cs), cs)
        self.valid[layer] = max(self.valid[layer], count)
        return self.means_buf[layer, :, :, :count]

    def rollback(self, length: int) -> None:
        """Tokens from `length` on are gone: drop the chunks they completed."""
        complete = length // self.chunk_size
        self.valid = [min(v, complete) for v in self.valid]
