"""Which cached tokens a sparse cache keeps: pure policy code, no model and no storage.

Every policy returns per-KV-head token indices [B, Hkv, N] (sorted ascending) into a full cache of
S tokens; the sparse cache gathers those entries. Queries are post-RoPE, like the cached keys.
"""
from __future__ import annotations

import torch

from triforce.kernels import chunk_mean_keys, grouped_scores, topk_sorted


def select_retrieval(query: torch.Tensor, keys: torch.Tensor, budget: int, chunk_size: int) -> torch.Tensor:
    """TriForce retrieval over resident keys: see select_by_chunk_scores."""
    scores = grouped_scores(query, chunk_mean_keys(keys, chunk_size))
    return select_by_chunk_scores(scores, keys.shape[2], budget, chunk_size)


def select_by_chunk_scores(scores: torch.Tensor, length: int, budget: int, chunk_size: int,
                           topk=topk_sorted) -> torch.Tensor:
    """Always the first chunk (attention sink) and the trailing partial chunk, then the complete
    chunks that score highest, up to `budget` tokens (ties go to the earlier chunk). scores:
    [B, Hkv, length // chunk_size], one per complete chunk (the query's dot product with the
    chunk's mean key, summed over a KV head's query heads). topk(scores, k) -> ascending indices
    of the k largest (a kernel's, see triforce.kernels.RetrievalKernels)."""
    batch, kv_heads = scores.shape[:2]
    device = scores.device
    if length <= budget:
        return _all(batch, kv_heads, length, device)
    num_chunks = length // chunk_size
    tail = length - num_chunks * chunk_size
    picks = (budget - tail) // chunk_size - 1  # chunks besides the first
    if picks < 0:
        raise ValueError(f"budget {budget} cannot hold the first chunk ({chunk_size}) and the tail ({tail})")
    rest = scores[..., 1:num_chunks]  # [B, Hkv, C-1]
    top = topk(rest, min(picks, rest.shape[-1])) + 1  # ascending
    first = torch.zeros(batch, kv_heads, 1, dtype=torch.long, device=device)
    chunks = torch.cat([first, top], -1)  # [B, Hkv, picks + 1], ascending
    offsets = torch.arange(chunk_size, device=device)
    tokens = (chunks[..., None] * chunk_size + offsets).flatten(-2)
    tail_idx = torch.arange(num_chunks * chunk_size, length, device=device).expand(batch, kv_heads, tail)
    return torch.cat([tokens, tail_idx], -1)


def select_streaming(batch: int, kv_heads: int, length: int, budget: int, sink_tokens: int,
                     device=None) -> torch.Tensor:
    """StreamingLLM: the first `sink_tokens` and the most recent tokens, `budget` in all."""
    if length <= budget:
        return _all(batch, kv_heads, length, device)
    sinks = min(sink_tokens, budget)
    idx = torch.cat([torch.arange(sinks, device=device), torch.arange(length - (budget - sinks), length, device=device)])
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
