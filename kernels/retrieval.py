"""Chunk scoring for the retrieval cache (torch reference path): mean keys of fixed-size chunks
and their dot product with a query, summed over the query heads that share a KV head."""
from __future__ import annotations

import torch


def grouped_scores(query: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """query: [B, H, D], keys: [B, Hkv, N, D] -> [B, Hkv, N]: q.k summed over the query heads
    that share each KV head (GQA)."""
    batch, heads, dim = query.shape
    groups = heads // keys.shape[1]
    q = query.reshape(batch, keys.shape[1], groups, dim).to(keys.dtype)
    return torch.einsum("bhgd,bhnd->bhn", q, keys)


def chunk_mean_keys(keys: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """keys: [B, Hkv, S, D] -> mean key of each complete chunk [B, Hkv, S // chunk_size, D]."""
    batch, kv_heads, length, dim = keys.shape
    num_chunks = length // chunk_size
    return keys[:, :, :num_chunks * chunk_size].reshape(batch, kv_heads, num_chunks, chunk_size, dim).mean(-2)
