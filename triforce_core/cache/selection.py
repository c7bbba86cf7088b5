"""Which cached tokens a sparse cache keeps: pure policy code, no model and no storage.

Every policy returns per-KV-head token indices [B, Hkv, N] (sorted ascending) into a full cache of
S tokens; the sparse cache gathers those entries. Queries are post-RoPE, like the cached keys.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from triforce.kernels import chunk_mean_keys, grouped_scores, topk_sorted

SNAPKV_KERNEL = 5  # SnapKV's pooling kernel, as the MagicDec paper uses it
SNAPKV_KEPT_BYTES = 64 << 20  # a layer's window logits up to this size are made once, not twice
_SNAPKV_KEYS = 8192  # keys scored at once: bounds the [B, H, W, keys] scores to ~10 MB per head group


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


def select_snapkv(window_queries: torch.Tensor, keys: torch.Tensor, budget: int,
                  kernel: int = SNAPKV_KERNEL) -> torch.Tensor:
    """SnapKV: the last W tokens (the observation window, whose post-RoPE queries are
    window_queries [B, H, W, D]) and the earlier tokens they attend to most, `budget` in all.
    Each earlier token's vote is its softmax attention weight summed over the window's queries
    and over the query heads of its KV head, then averaged over `kernel` neighbours (so a chosen
    token brings its context); the top votes are kept, ascending. keys: [B, Hkv, S, D], the
    window's own keys last."""
    batch, kv_heads, length, dim = keys.shape
    if length <= budget:
        return _all(batch, kv_heads, length, keys.device)
    window = window_queries.shape[2]
    if budget <= window:
        raise ValueError(f"a SnapKV budget must exceed its observation window ({window} tokens), got {budget}")
    group = window_queries.shape[1] // kv_heads
    q = window_queries.float().reshape(batch, kv_heads, group * window, dim) * dim ** -0.5
    prefix = length - window
    # the window's queries see every earlier token and the window causally: a softmax over slices
    # of keys (the max first, then each slice's weights), so no [B, H, W, S] tensor is ever whole;
    # the slices' weights are kept where they fit SNAPKV_KEPT_BYTES, else made again. A token's
    # vote: its weights summed over the rows, as one matrix-vector product.
    slices = range(0, length, _SNAPKV_KEYS)
    kept = [] if q.numel() * length * 4 <= SNAPKV_KEPT_BYTES else None
    top = torch.full(q.shape[:3], -torch.inf, device=q.device)
    for lo in slices:
        logits = _window_logits(q, keys, lo, window, prefix)
        top = torch.maximum(top, logits.amax(-1))
        if kept is not None:
            kept.append(logits)
    for logits in kept or ():
        logits.sub_(top[..., None]).exp_()

    def weights(i: int, lo: int) -> torch.Tensor:  # exp(logits - top): slice i's unnormalised weights
        if kept is not None:
            return kept[i]
        return _window_logits(q, keys, lo, window, prefix).sub_(top[..., None]).exp_()

    rows = sum(weights(i, lo).sum(-1) for i, lo in enumerate(slices)).reciprocal()[..., None, :]  # [B, Hkv, 1, R]
    vote = torch.cat([(rows @ weights(i, lo))[..., 0, :] for i, lo in enumerate(slices) if lo < prefix],
                     -1)[..., :prefix]
    pooled = F.avg_pool1d(vote, kernel, stride=1, padding=kernel // 2) if kernel > 1 else vote
    chosen = torch.sort(torch.topk(pooled, budget - window, dim=-1).indices, dim=-1).values
    tail = torch.arange(prefix, length, device=keys.device).expand(batch, kv_heads, window)
    return torch.cat([chosen, tail], -1)


def _window_logits(q: torch.Tensor, keys: torch.Tensor, lo: int, window: int, prefix: int) -> torch.Tensor:
    """Scaled logits [B, Hkv, group * W, n] of the window's queries (row g * W + t: the group's
    query head g at window token t) against keys [lo, lo + n), -inf where that token may not
    see the key."""
    k = keys[:, :, lo:lo + _SNAPKV_KEYS].float()
    logits = q @ k.transpose(-1, -2)
    first = max(prefix + 1 - lo, 0)  # every row sees the keys before prefix + 1: only the window's masked
    if first < k.shape[2]:
        token = torch.arange(q.shape[2], device=q.device) % window  # the window token of each row
        seen = torch.arange(lo + first, lo + k.shape[2], device=q.device)[None, :] <= prefix + token[:, None]
        logits[..., first:].masked_fill_(~seen, -torch.inf)
    return logits


def _all(batch: int, kv_heads: int, length: int, device) -> torch.Tensor:
    return torch.arange(length, device=device).expand(batch, kv_heads, length)
