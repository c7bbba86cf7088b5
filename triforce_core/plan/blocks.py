"""How the offloaded KV is cut into blocks: block length, and the whole blocks that move to the
device once a prefill's scratch is free (pure arithmetic, used by the planner)."""
from __future__ import annotations

ALIGN_TOKENS = 256  # resident and block sizes are multiples of this (chunk sizes divide it)


def choose_block_tokens(per_token_layer: int, staging_bytes: int, host_tokens: int) -> int:
    """Tokens per streamed block: about `staging_bytes` per block, a multiple of ALIGN_TOKENS,
    no longer than needed for the host range."""
    block = max(ALIGN_TOKENS, staging_bytes // per_token_layer // ALIGN_TOKENS * ALIGN_TOKENS)
    return min(block, align_up(max(host_tokens, 1)))


def align_up(n: int, to: int = ALIGN_TOKENS) -> int:
    return -(-n // to) * to


def promoted_tokens(free_bytes: int, per_token: int, block: int, host_tokens: int) -> int:
    """Host tokens whose KV moves to the GPU once decoding starts: whole filled blocks (of
    host_tokens) in `free_bytes`, the prefill scratch then unused."""
    return min(free_bytes // per_token, host_tokens) // block * block
