"""Sparse KV cache for a drafting tier of the target model: entries selected from the full
cache by a policy (retrieval chunks, StreamingLLM sink + window, oracle top-k), followed by the
KV of tokens appended since the last selection.

A sliding-window layer (Gemma 3's local ones, Mistral's) whose window is shorter than the context
sees only its latest tokens in the target, so no policy's pick elsewhere can help it: it keeps the
latest tokens instead (as many as the others select), in order, and attends through its window
as the target does; with a budget of at least its window, the layer is exact in the draft."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from triforce.cache.selection import (select_by_chunk_scores, select_retrieval, select_snapkv, select_streaming,
                                      select_topk)
from triforce.cache_contract import BufferStep, FullCache, buffer_decoder
from triforce.config import SNAPKV_WINDOW
from triforce.config.model import ModelConfig
from triforce.kernels import SDPA


@dataclass(frozen=True)
class _Policy:
    budget: int
    chunk_size: int = 8
    sink_tokens: int = 16
    window: int = SNAPKV_WINDOW
    kind = ""
    by_window = False  # selects by its observation window's queries [B, H, W, D], not one token's [B, H, D]

    def __post_init__(self):
        if self.budget < 1:
            raise ValueError("the budget must be at least one token")

    def select(self, query: torch.Tensor | None, keys: torch.Tensor) -> torch.Tensor:
        """query: [B, H, D] post-RoPE (or the window's, by_window); keys [B, Hkv, S, D] -> [B, Hkv, N]."""
        raise NotImplementedError

    def select_from(self, full: FullCache, layer: int, query: torch.Tensor | None) -> torch.Tensor:
        """The same choice made through a full cache's read interface, so caches that keep part of
        their KV off the device need not materialise more than the policy reads."""
        return self.select(query, full.keys(layer))


class RetrievalPolicy(_Policy):
    """TriForce's retrieval cache: the chunks whose mean key best matches the query."""
    kind = "retrieval"

    def __post_init__(self):
        super().__post_init__()
        if self.budget < 2 * self.chunk_size:
            raise ValueError(f"a retrieval budget must hold at least two chunks ({2 * self.chunk_size} tokens)")

    def select(self, query, keys):
        return select_retrieval(query, keys, self.budget, self.chunk_size)

    def select_from(self, full, layer, query):
        scores = full.chunk_scores(layer, query, self.chunk_size)  # never the whole layer's keys
        return select_by_chunk_scores(scores, full.length, self.budget, self.chunk_size, full.top_chunks)


class StreamingPolicy(_Policy):
    """StreamingLLM: the sink tokens and the most recent window; reads no keys."""
    kind = "streaming"

    def select(self, query, keys):
        batch, kv_heads, length, _ = keys.shape
        return select_streaming(batch, kv_heads, length, self.budget, self.sink_tokens, keys.device)

    def select_from(self, full, layer, query):
        return select_streaming(full.batch, full.kv_heads, full.length, self.budget, self.sink_tokens, full.device)


class TopKPolicy(_Policy):
    """The oracle: the tokens the query attends to most (needs every key)."""
    kind = "topk"

    def select(self, query, keys):
        return select_topk(query, keys, self.budget)


class SnapKVPolicy(_Policy):
    """SnapKV (MagicDec's drafts): the tokens the observation window attends to most, pooled."""
    kind = "snapkv"
    by_window = True

    def __post_init__(self):
        super().__post_init__()
        if self.budget <= self.window:
            raise ValueError(f"a SnapKV budget must exceed its observation window ({self.window} tokens)")

    def select(self, query, keys):
        return select_snapkv(_window(query), keys, self.budget)


POLICY_CLASSES = {cls.kind: cls for cls in (RetrievalPolicy, StreamingPolicy, TopKPolicy, SnapKVPolicy)}
POLICIES = tuple(POLICY_CLASSES)


def SelectionPolicy(kind: str, budget: int, chunk_size: int = 8, sink_tokens: int = 16,  # noqa: N802 (a factory)
                    window: int = SNAPKV_WINDOW) -> _Policy:
    """The policy of `kind` (retrieval | streaming | topk | snapkv), budget in tokens."""
    if kind not in POLICY_CLASSES:
        raise ValueError(f"unknown selection policy '{kind}'")
    return POLICY_CLASSES[kind](budget, chunk_size, sink_tokens, window)


def _window(query: torch.Tensor | None) -> torch.Tensor:
    if query is None or query.dim() != 4:
        raise ValueError("SnapKV selects by its observation window's queries [B, H, W, D]")
    return query


class SparseKVCache:
    """k_buf, v_buf: [num_layers, B, Hkv, capacity, D]; entries [0, num_selected) come from the
    last selection, then one entry per token appended since (logical positions build_point..)."""

    def __init__(self, cfg: ModelConfig, policy: _Policy, max_appended: int, *, batch: int = 1,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", attn=SDPA):
        self.policy = policy
        self.attn = attn
        self.capacity = policy.budget + max_appended
        shape = (cfg.num_layers, batch, cfg.num_kv_heads, self.capacity, cfg.head_dim)
        self.k_buf = torch.zeros(shape, dtype=dtype, device=device)
        self.v_buf = torch.zeros(shape, dtype=dtype, device=device)
        self.scale = cfg.head_dim ** -0.5
        self.decoder = buffer_decoder(attn, self.k_buf, self.v_buf, self.scale)
        self.sliding_windows = cfg.sliding_windows
        self.windowed: tuple[int | None, ...] = (None,) * cfg.num_layers  # the layers holding their latest tokens
        self.num_selected = 0
        self.build_point = 0  # logical length covered by the selection
        self.length = 0       # logical length covered in all

    @property
    def end(self) -> int:
        """Physical entries in use."""
        return self.num_selected + self.length - self.build_point

    @property
    def room(self) -> int:
        """Tokens that can still be appended before a rebuild is needed."""
        return self.capacity - self.end

    @property
    def appended(self) -> int:
        return self.length - self.build_point

    def rebuild(self, full: FullCache, queries: list[torch.Tensor] | None) -> None:
        """Select from the whole full cache. queries: per layer [B, H, D] (None for streaming, and
        for an empty full cache: a one-token prompt leaves nothing to select from)."""
        if full.length == 0:
            self.num_selected = self.build_point = self.length = 0
            return
        self.windowed = tuple(w if w is not None and w < full.length else None for w in self.sliding_windows)
        n = min(self.policy.budget, full.length)  # what a policy selects when every layer is windowed
        chosen = [(layer, self.policy.select_from(full, layer, None if queries is None else queries[layer]))
                  for layer, w in enumerate(self.windowed) if w is None]
        n = chosen[-1][1].shape[-1] if chosen else n
        windowed = [i for i, w in enumerate(self.windowed) if w is not None]
        if windowed:
            shape = (self.k_buf.shape[1], self.k_buf.shape[2], n)
            latest = torch.arange(full.length - n, full.length, device=self.k_buf.device).expand(shape).contiguous()
            chosen += [(layer, latest) for layer in windowed]
        full.gather_layers(chosen, self.k_buf, self.v_buf)  # every layer's indices first: one wait, not one a layer
        self.num_selected = n
        self.build_point = self.length = full.length

    def append_from(self, full: FullCache, start: int, end: int) -> None:
        """Append the full cache's (exact) KV of tokens [start, end)."""
        if start != self.length:
            raise ValueError(f"append_from({start}) but the sparse cache covers {self.length}")
        count = end - start
        if count > self.room:
            raise ValueError("sparse cache overflow: rebuild first")
        at = self.end
        self.k_buf[:, :, :, at:at + count], self.v_buf[:, :, :, at:at + count] = full.kv_range(start, end)
        self.length = end

    def step(self, num_new: int) -> BufferStep:
        if num_new > self.room:
            raise ValueError("sparse cache overflow: rebuild first")
        start = self.end
        positions = torch.arange(self.length, self.length + num_new, device=self.k_buf.device)[None]
        self.length += num_new
        # a windowed layer's slots are its latest tokens in order: the window masks by slot as by position
        return BufferStep(self, start, start + num_new, positions, sliding_windows=self.windowed)

    def rollback(self, length: int) -> None:
        if not self.build_point <= length <= self.length:
            raise ValueError(f"cannot roll back to {length}: covers {self.build_point}..{self.length}")
        self.length = length

