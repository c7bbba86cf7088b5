"""Attention of new queries over a KV view.

Convention shared by every cache: the T new queries are the *last* T positions of the S keys
("bottom-right aligned" causality), so query i may see key j iff j <= S - T + i.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_mask(num_queries: int, num_keys: int, device: torch.device,
                sliding_window: int | None = None) -> torch.Tensor:
    """Boolean [T, S] mask, True where query i may attend to key j."""
    offset = num_keys - num_queries
    q_idx = torch.arange(num_queries, device=device)[:, None] + offset
    k_idx = torch.arange(num_keys, device=device)[None, :]
    allowed = k_idx <= q_idx
    if sliding_window is not None:
        allowed &= k_idx > q_idx - sliding_window
    return allowed


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float,
              sliding_window: int | None = None) -> torch.Tensor:
    """q: [B, H, T, D]; k, v: [B, Hkv, S, D] with H a multiple of Hkv. Returns [B, H, T, D]."""
    num_queries, num_keys = q.shape[-2], k.shape[-2]
    window_binds = sliding_window is not None and num_keys > sliding_window
    gqa = q.shape[1] != k.shape[1]
    if num_queries == 1 and not window_binds:
        # One query sees every key: fold the query heads sharing a KV head into rows, so the
        # kernel reads each K/V head once instead of expanding it per query head.
        batch, heads, _, dim = q.shape
        folded = q.reshape(batch, k.shape[1], heads // k.shape[1], dim)
        return F.scaled_dot_product_attention(folded, k, v, scale=scale).reshape(batch, heads, 1, dim)
    if num_queries == num_keys and not window_binds:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    mask = causal_mask(num_queries, num_keys, q.device, sliding_window if window_binds else None)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
