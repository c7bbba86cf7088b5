"""Which cached tokens a sparse cache keeps: pure policy code, no model and no storage.

Every policy returns per-KV-head token indices [B, Hkv, N] (sorted ascending) into a full cache of
S tokens; the sparse cache gathers those entries. Queries are post-RoPE, like the cached keys.
"""
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


def select_retrieval(query: torch.Tensor, keys: torch.Tensor, budget: int, chunk_size: int) -> torch.Tensor:
    """TriForce retrieval: always the first chunk (attention sink) and the trailing partial chunk,
    then the complete chunks whose mean key scores highest, up to `budget` tokens."""
    batch, kv_heads, length, _ = keys.shape
    if length <= budget:
        return _all(batch, kv_heads, length, keys.device)
    num_chunks = length // chunk_size
    tail = length - num_chunks * chunk_size
    picks = (budget - tail) // chunk_size - 1  # chunks besides the first
    if picks < 0:
        raise ValueError(f"budget {budget} cannot hold the first chunk ({chunk_size}) and the tail ({tail})")
    scores = grouped_scores(query, chunk_mean_keys(keys, chunk_size))[..., 1:]  # [B, Hkv, C-1]
    top = torch.topk(scores, min(picks, scores.shape[-1]), dim=-1).indices + 1
    first = torch.zeros(batch, kv_heads, 1, dtype=torch.long, device=keys.device)
    chunks = torch.sort(torch.cat([first, top], -1), dim=-1).values  # [B, Hkv, picks + 1]
    offsets = torch.arange(chunk_size, device=keys.device)
    tokens = (chunks[..., None] * chunk_size + offsets).flatten(-2)
    tail_idx = torch.arange(num_chunks * chunk_size, length, device=keys.device).expand(batch, kv_heads, tail)
    return torch.cat([tokens, tail_idx], -1)


def select_streaming(keys: torch.Tensor, budget: int, sink_tokens: int) -> torch.Tensor:
    """StreamingLLM: the first `sink_tokens` and the most recent tokens, `budget` in all."""
    batch, kv_heads, length, _ = keys.shape
    if length <= budget:
        return _all(batch, kv_heads, length, keys.device)
    sinks = min(sink_tokens, budget)
    idx = torch.cat([torch.arange(sinks), torch.arange(length - (budget - sinks), length)]).to(keys.device)
    return idx.expand(batch, kv_heads, budget)


def select_topk(query: torch.Tensor, keys: torch.Tensor, budget: int) -> torch.Tensor:
    """Oracle token-level top-k by q.k (an upper bound for chunked retrieval; evaluation only)."""
    batch, kv_heads, length, _ = keys.shape
    if length <= budget:
        return _all(batch, kv_heads, length, keys.device)
    scores = grouped_scores(query, keys)
    return torch.sort(torch.topk(scores, budget, dim=-1).indices, dim=-1).values


def _all(batch: int, kv_heads: int, length: int, device) -> torch.Tensor:
    return torch.arange(length, device=device).expand(batch, kv_heads, length)
