"""The full KV cache held wholly on the device: preallocated per-layer K/V with append and rollback.

Every cache in triforce hands the model a per-forward *step* (triforce.cache_contract.CacheStep)
with `positions` (the RoPE positions of the new tokens) and `attend(layer, q, k, v)`; the caches
differ only in what they keep. Keys are stored after RoPE, so an entry keeps its position
wherever it is copied."""
from __future__ import annotations

import torch

from triforce.cache_contract import BufferStep, buffer_decoder
from triforce.config.model import ModelConfig
from triforce.errors import UserError
from triforce.kernels import SDPA, RetrievalKernels
from triforce.kernels.chunk_means import ChunkMeans


class ResidentKVCache:
    """Keys and values of every token so far, for every layer, on one device (a FullCache).

    k_buf, v_buf: [num_layers, B, Hkv, max_len, D]. Entries [0, length) are valid."""

    layer_major = False  # prefill may run chunk by chunk through all layers
    host_nbytes = 0      # nothing lives in host memory

    def __init__(self, cfg: ModelConfig, max_len: int, *, batch: int = 1,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", attn=SDPA):
        shape = (cfg.num_layers, batch, cfg.num_kv_heads, max_len, cfg.head_dim)
        self.attn = attn  # attention backend (triforce.kernels.select_attention)
        self.k_buf = torch.zeros(shape, dtype=dtype, device=device)
        self.v_buf = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len
        self.length = 0
        self.scale = cfg.head_dim ** -0.5
        self.decoder = buffer_decoder(attn, self.k_buf, self.v_buf, self.scale)
        self.sliding_windows = cfg.sliding_windows
        self.kernels = RetrievalKernels.for_device(self.k_buf.device)
        self._means: dict[int, ChunkMeans] = {}  # by chunk size, made at the first retrieval

    @property
    def nbytes(self) -> int:
        return self.k_buf.nbytes + self.v_buf.nbytes + sum(m.nbytes for m in self._means.values())

    def step(self, num_new: int, record_queries: bool = False, prefill: bool = False) -> BufferStep:
        """Reserve slots for `num_new` tokens and return the view one forward pass writes into.
        With record_queries, the step keeps each layer's post-RoPE queries (for retrieval)."""
        if self.length + num_new > self.max_len:
            raise UserError(f"context full: {self.length} + {num_new} tokens exceed the cache's "
                            f"{self.max_len} slots")
        start = self.length
        self.length += num_new
        positions = torch.arange(start, self.length, device=self.k_buf.device)[None]
        return BufferStep(self, start, self.length, positions, record_queries, self.sliding_windows)

    def rollback(self, length: int) -> None:
        """Forget every entry at index >= length (rejected speculative tokens, an aborted step)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot roll back to {length}: cache holds {self.length}")
        self.length = length
        for means in self._means.values():
            means.rollback(length)

    @property
    def end(self) -> int:
        """The next free slot (a graph runner's name for the length)."""
        return self.length

    @property
    def batch(self) -> int:
        return self.k_buf.shape[1]

    @property
    def kv_heads(self) -> int:
        return self.k_buf.shape[2]

    @property
    def device(self) -> torch.device:
        return self.k_buf.device

    def keys(self, layer: int) -> torch.Tensor:
        return self.k_buf[layer, :, :, :self.length]

    def values(self, layer: int) -> torch.Tensor:
        return self.v_buf[layer, :, :, :self.length]

    # ---- the read interface sparse caches use (the FullCache contract) ----------------------
    def top_chunks(self, scores: torch.Tensor, k: int) -> torch.Tensor:
        return self.kernels.topk(scores, k)

    def expect_chunks(self, chunk_size: int) -> None:
        pass  # its keys never leave the device: chunk_scores averages them there when asked

    def chunk_scores(self, layer: int, query: torch.Tensor, chunk_size: int) -> torch.Tensor:
        """query [B, H, D] -> [B, Hkv, length // chunk_size]: q . mean key of each complete chunk.
        Mean keys are kept and extended only by chunks completed since the last call."""
        if chunk_size not in self._means:
            self._means[chunk_size] = ChunkMeans.like(self.k_buf, chunk_size)
        keys = self.k_buf[layer]
        means = self._means[chunk_size].read(layer, self.length // chunk_size,
                                             lambda start, end: keys[:, :, start:end])
        return self.kernels.scores(query, means)

    def gather_into(self, layer: int, index: torch.Tensor, k_dst: torch.Tensor, v_dst: torch.Tensor) -> None:
        """index [B, Hkv, N] -> k_dst, v_dst [B, Hkv, N, D]: the keys and values of those tokens."""
        self.kernels.gather_into(self.keys(layer), self.values(layer), index, k_dst, v_dst)

    def gather_layers(self, chosen: list[tuple[int, torch.Tensor]], k_buf: torch.Tensor, v_buf: torch.Tensor) -> None:
        """For each (layer, index [B, Hkv, N]): k_buf[layer, :, :, :N], v_buf[...] <- those tokens' KV."""
        for layer, index in chosen:
            n = index.shape[-1]
            self.gather_into(layer, index, k_buf[layer, :, :, :n], v_buf[layer, :, :, :n])

    def kv_range(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [L, B, Hkv, end - start, D] of tokens [start, end), every layer."""
        return self.k_buf[:, :, :, start:end], self.v_buf[:, :, :, start:end]

    def prepare_verify(self) -> None:
        """Nothing to fetch: every entry is resident."""

