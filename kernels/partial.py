"""Partial attention over one block of keys, and merging partial results by log-sum-exp.

Attention over keys split into blocks (GPU-resident part, streamed host blocks, the new tokens)
equals the merge of each block's partial result: out_i weighted by exp(lse_i - lse), where
lse = log(sum_i exp(lse_i)). Positions are absolute, so a block knows which queries may see
which of its keys (causality, sliding windows) without the caller building masks.
"""
from __future__ import annotations

import torch

from triforce.kernels.device_kind import on_cuda

# Score elements per tile: bounds the [H, T, S] temporary of long prefills (decode steps, with a
# handful of queries, see a whole block in one tile).
MAX_SCORE_ELEMENTS = 1 << 22
KEY_TILE = 1024  # keys per tile at least


def _block_mask(q_start: int, num_queries: int, k_start: int, num_keys: int, device,
                sliding_window: int | None) -> torch.Tensor | None:
    """[T, S] True where query (absolute q_start + i) may see key (absolute k_start + j); None if all may."""
    q_last, k_last = q_start + num_queries - 1, k_start + num_keys - 1
    causal_binds = k_last > q_start
    window_binds = sliding_window is not None and k_start <= q_last - sliding_window
    if not causal_binds and not window_binds:
        return None
    q_pos = torch.arange(q_start, q_start + num_queries, device=device)[:, None]
    k_pos = torch.arange(k_start, k_start + num_keys, device=device)[None, :]
    allowed = k_pos <= q_pos
    if sliding_window is not None:
        allowed &= k_pos > q_pos - sliding_window
    return allowed


def block_visible(q_start: int, num_queries: int, k_start: int, num_keys: int,
                  sliding_window: int | None) -> bool:
    """Whether any query may see any key of the block (a window can hide a whole block)."""
    if k_start > q_start + num_queries - 1:
        return False
    if sliding_window is None:
        return True
    return k_start + num_keys - 1 > q_start - sliding_window


def partial_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float,
                      q_start: int, k_start: int, sliding_window: int | None = None,
                      max_score_elements: int = MAX_SCORE_ELEMENTS) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [B, H, T, D] at absolute positions q_start..; k, v: [B, Hkv, S, D] at k_start...

    Returns (out [B, H, T, D], lse [B, H, T]), both float32 (float64 for float64 input) so merging
    adds no rounding of q's dtype. Rows that see no key get out 0 and lse -inf, which the merge
    weighs as nothing. Scores are computed in tiles of at most `max_score_elements`."""
    batch, heads, num_queries, dim = q.shape
    num_keys = k.shape[2]
    calc = torch.float64 if q.dtype == torch.float64 else torch.float32
    rows = batch * heads
    key_tile = min(num_keys, max(KEY_TILE, max_score_elements // (rows * num_queries)))
    query_tile = min(num_queries, max(1, max_score_elements // (rows * key_tile)))
    outs, lses = [], []
    for t0 in range(0, num_queries, query_tile):
        t1 = min(num_queries, t0 + query_tile)
        acc = PartialAccumulator()
        for s0 in range(0, num_keys, key_tile):
            s1 = min(num_keys, s0 + key_tile)
            if block_visible(q_start + t0, t1 - t0, k_start + s0, s1 - s0, sliding_window):
                acc.add(*_tile(q[:, :, t0:t1], k[:, :, s0:s1], v[:, :, s0:s1], scale, q_start + t0,
                               k_start + s0, sliding_window, calc))
        if acc.out is None:  # no key of the block is visible to these queries
            acc.add(torch.zeros(batch, heads, t1 - t0, dim, dtype=calc, device=q.device),
                    torch.full((batch, heads, t1 - t0), float("-inf"), dtype=calc, device=q.device))
        outs.append(acc.out)
        lses.append(acc.lse)
    if len(outs) == 1:
        return outs[0], lses[0]
    return torch.cat(outs, 2), torch.cat(lses, 2)


def _tile(q, k, v, scale, q_start, k_start, sliding_window, calc):
    batch, heads, num_queries, dim = q.shape
    kv_heads, num_keys = k.shape[1], k.shape[2]
    groups = heads // kv_heads
    qt = q.to(calc).reshape(batch, kv_heads, groups * num_queries, dim)
    scores = torch.matmul(qt, k.to(calc).transpose(-1, -2)).mul_(scale)  # [B, Hkv, G*T, S]
    scores = scores.view(batch, kv_heads, groups, num_queries, num_keys)
    mask = _block_mask(q_start, num_queries, k_start, num_keys, q.device, sliding_window)
    if mask is not None:
        scores.masked_fill_(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [B, Hkv, G, T]
    # probabilities in place; a row that sees no key has lse -inf, and clamping keeps exp at 0
    scores.sub_(lse[..., None].clamp_min(torch.finfo(calc).min)).exp_()
    out = torch.matmul(scores.view(batch, kv_heads, groups * num_queries, num_keys), v.to(calc))
    return out.view(batch, heads, num_queries, dim), lse.reshape(batch, heads, num_queries)


HALF = (torch.float16, torch.bfloat16)


def block_kind(num_queries: int, num_keys: int, q_start: int, k_start: int,
               sliding_window: int | None) -> str | None:
    """The mask a block of keys needs, by position alone: "whole" when every query sees every
    key (old tokens before a pass), "diagonal" when the keys end with the queries and each query
    sees the keys up to its own position (a pass's own new tokens), None otherwise (a sliding
    window hides some keys, or keys lie past the last query)."""
    if sliding_window is not None and k_start <= q_start + num_queries - 1 - sliding_window:
        return None
    if k_start + num_keys - 1 <= q_start:
        return "whole"
    if k_start <= q_start and k_start + num_keys == q_start + num_queries:
        return "diagonal"
    return None


def fusable(q: torch.Tensor) -> bool:
    """Whether a fused kernel takes q's dtype here: half precision on any device, float32 on the CPU."""
    return q.dtype in HALF or (q.dtype == torch.float32 and not on_cuda(q))


def fused_shape(q: torch.Tensor, num_keys: int, q_start: int, k_start: int,
                sliding_window: int | None) -> str | None:
    """Which fused kernel serves this block, if any (block_kind's names): half precision on any
    device, float32 on the CPU, whose flash kernel takes it too. A "diagonal" block's causal part
    is a square (as many keys as queries), where CUDA's flash kernel masks as the CPU's does."""
    if num_keys == 0 or not fusable(q):
        return None
    return block_kind(q.shape[2], num_keys, q_start, k_start, sliding_window)


def causal_pieces(num_queries: int, num_keys: int, q_start: int, k_start: int) -> list[tuple[int, int, int, str | None]]:
    """A block whose keys run past some queries (a prefill's resident head, or its new tokens
    seen by queries before them), split by query into pieces block_kind names: queries before
    the block's first key see none of it (shape None), those among its keys a "diagonal" (the
    keys up to theirs), those after it the "whole" block. [(first query, end, keys, shape)]."""
    q_end, k_end = q_start + num_queries, k_start + num_keys
    sees = min(max(k_start, q_start), q_end)  # the first query that sees a key
    past = min(max(k_end, q_start), q_end)    # the first query past the block
    pieces = [(q_start, sees, 0, None)] if sees > q_start else []
    if past > sees:
        pieces.append((sees, past, past - k_start, "diagonal"))
    if q_end > past:
        pieces.append((past, q_end, num_keys, "whole"))
    return pieces


def fused_partial(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float,
                  shape: str = "whole", q_start: int = 0, k_start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Partial attention in PyTorch's flash kernel (CUDA, or its CPU twin), which also returns
    the log-sum-exp, for a block of the kind fused_shape named. A "whole" block folds the query
    heads sharing a KV head into rows, so K and V are read once in their own dtype: no float32
    copy of the block, no per-tile chain of small kernels. A "diagonal" block is its whole head
    (keys before the first query) and a causal square (the queries' own keys), which the kernel
    masks itself, skipping the hidden half instead of computing and discarding it.
    q [B, H, T, D]; k, v [B, Hkv, S, D] (last dim contiguous). Returns float32 (out [B, H, T, D],
    lse [B, H, T]) like partial_attention."""
    if shape == "whole":
        return _flash(q, k, v, scale, causal=False)
    head = q_start - k_start
    acc = PartialAccumulator()
    if head:
        acc.add(*_flash(q, k[:, :, :head], v[:, :, :head], scale, causal=False))
    acc.add(*_flash(q, k[:, :, head:], v[:, :, head:], scale, causal=True))
    return acc.out, acc.lse


def _flash(q, k, v, scale: float, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    batch, heads, num_queries, dim = q.shape
    kv_heads = k.shape[1]
    groups = heads // kv_heads
    if causal:
        # the mask runs along rows, so query heads cannot be folded into them; rather than expand
        # K/V to every query head (memory the plan does not hold), one call per query head of
        # each KV head: heads g, g + groups, ... pair with KV heads 0, 1, ...
        parts = [_flash_call(q[:, g::groups], k, v, scale, True) for g in range(groups)]
        out = torch.stack([o for o, _ in parts], 2).reshape(batch, heads, num_queries, dim)
        lse = torch.stack([lse for _, lse in parts], 2).reshape(batch, heads, num_queries)
    else:
        out, lse = _flash_call(q.reshape(batch, kv_heads, groups * num_queries, dim), k, v, scale, False)
    return out.reshape(batch, heads, num_queries, dim).float(), lse.reshape(batch, heads, num_queries).float()


def _flash_call(rows, k, v, scale: float, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if rows.is_cuda:
        return torch.ops.aten._scaled_dot_product_flash_attention(rows, k, v, 0.0, causal, False, scale=scale)[:2]
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(rows, k, v, 0.0, causal, scale=scale)[:2]


class PartialAccumulator:
    """Running log-sum-exp merge, so streamed blocks need not all be held at once."""

    def __init__(self):
        self.out: torch.Tensor | None = None   # [B, H, T, D] in lse's dtype
        self.lse: torch.Tensor | None = None   # [B, H, T]

    def add(self, out: torch.Tensor, lse: torch.Tensor) -> None:
        if self.out is None:  # its own copy, merged into in place: temporaries of the output's size ran
            # a 24 GB card out of memory (bench/history/2026-11-28-gpu-campaign-h200.md)
            self.out, self.lse = out.to(lse.dtype, copy=True), lse
            return
        total = torch.logaddexp(self.lse, lse)
        finite = torch.isfinite(total)
        keep = torch.where(finite, torch.exp(self.lse - total), torch.zeros_like(total))
        take = torch.where(finite, torch.exp(lse - total), torch.zeros_like(total))
        self.out.mul_(keep[..., None]).addcmul_(out, take[..., None])
        self.lse = total

    def result(self, dtype: torch.dtype) -> torch.Tensor:
        if self.out is None:
            raise ValueError("no partial results to merge")
        return self.out.to(dtype)


def merge_partials(parts: list[tuple[torch.Tensor, torch.Tensor]], dtype: torch.dtype) -> torch.Tensor:
    """Combine partial results over disjoint key blocks into the attention over their union, in
    `dtype`. parts: [(out [B, H, T, D], lse [B, H, T])]; some part must see a key for every row."""
    acc = PartialAccumulator()
    for out, lse in parts:
        acc.add(out, lse)
    return acc.result(dtype)
