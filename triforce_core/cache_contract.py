"""What the model and the tiers may ask of a KV cache.

`CacheView`: one forward pass's access (the model only calls `attend`). `FullCache`: the target's
full cache, which the full tier decodes over and the sparse caches select from; the resident
cache (triforce.cache.resident) and the offloaded one (triforce.cache.offloaded) both
implement all of it. `CacheStep`: the one base of every cache's per-pass view; it writes the new
KV, records queries when asked and attends, and a cache chooses only where its KV lives."""
from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


class CacheView(Protocol):
    """One forward pass's access to a KV cache."""

    positions: torch.Tensor  # [B, T] RoPE positions of the pass's new tokens

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Store the new k, v ([B, Hkv, T, D], after RoPE) of `layer` and return the attention
        output [B, H, T, D] of q ([B, H, T, D]) over the cached keys plus the new ones."""


@runtime_checkable
class FullCache(Protocol):
    """Every token's KV for every layer, wherever it lives. Entries [0, length) are valid."""

    length: int
    max_len: int
    layer_major: bool  # prefill as one pass, layer by layer (KV leaves the device per layer)

    @property
    def batch(self) -> int: ...

    @property
    def kv_heads(self) -> int: ...

    @property
    def device(self) -> torch.device: ...

    @property
    def nbytes(self) -> int:
        """Device bytes held."""

    @property
    def host_nbytes(self) -> int:
        """Host bytes held."""

    def step(self, num_new: int, record_queries: bool = False, prefill: bool = False) -> "CacheStep":
        """Reserve `num_new` slots; the returned view is what one forward pass writes into.
        prefill: the pass appends input (not a verify whose tokens the sparse tiers will take)."""

    def rollback(self, length: int) -> None:
        """Forget every entry at index >= length."""

    def prepare_verify(self) -> None:
        """Start fetching what the coming pass reads (a no-op where everything is resident)."""

    def expect_chunks(self, chunk_size: int) -> None:
        """A retrieval tier will score chunks of this size (a cache that sends keys off the device
        may average them on their way)."""

    def chunk_scores(self, layer: int, query: torch.Tensor, chunk_size: int) -> torch.Tensor:
        """query [B, H, D] -> [B, Hkv, length // chunk_size]: query . mean key of each complete chunk."""

    def top_chunks(self, scores: torch.Tensor, k: int) -> torch.Tensor:
        """scores [B, Hkv, C] (from chunk_scores) -> int64 [B, Hkv, k]: the k best chunks, ascending,
        ties to the lower index, by the kernel of the cache's device."""

    def keys(self, layer: int) -> torch.Tensor:
        """Keys [B, Hkv, length, D] of `layer` on the device."""

    def gather_into(self, layer: int, index: torch.Tensor, k_dst: torch.Tensor, v_dst: torch.Tensor) -> None:
        """index [B, Hkv, N] -> k_dst, v_dst [B, Hkv, N, D]: the keys and values of those tokens."""

    def gather_layers(self, chosen: list[tuple[int, torch.Tensor]], k_buf: torch.Tensor, v_buf: torch.Tensor) -> None:
        """gather_into for several layers at once, each (layer, index [B, Hkv, N]) into k_buf[layer,
        :, :, :N], v_buf[...] (a cache with host KV waits once for all their indices, not a layer at a time)."""

    def kv_range(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [L, B, Hkv, end - start, D] of tokens [start, end), every layer, on the device."""


class CacheStep:
    """A pass over new tokens that take slots [start, end) of its cache (logical positions in
    `positions`). The model calls attend once per layer, or, in a long layer-major pass, once per
    group of queries in order; `first` is where the group's tokens begin.

    Subclasses say where KV goes and what a query sees: `write(layer, first, k, v)` and
    `attend_written(layer, q, first)`."""

    def __init__(self, start: int, end: int, positions: torch.Tensor, num_layers: int,
                 record_queries: bool = False):
        self.start, self.end, self.positions, self.num_layers = start, end, positions, num_layers
        # per layer, the queries [B, H, T, D] of its latest attend call
        self.queries: list[torch.Tensor | None] | None = [None] * num_layers if record_queries else None
        self._filled = [0] * num_layers

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        first = self.claim(layer, q)
        self.write(layer, first, k, v)
        return self.attend_written(layer, q, first)

    def claim(self, layer: int, q: torch.Tensor) -> int:
        """Take the slots of q's tokens in `layer` (recording q where asked); returns the first."""
        first = self.start + self._filled[layer]
        if first + q.shape[2] > self.end:
            raise ValueError(f"layer {layer} attended past the step's {self.end - self.start} new tokens")
        self._filled[layer] += q.shape[2]
        if self.queries is not None:
            self.queries[layer] = q
        return first

    def kernel_slots(self, layer: int, dtype: torch.dtype, batch: int, heads: int, tokens: int):
        """(decoder, first slot, keys, queries) where a caller may write `layer`'s new KV and attend
        straight over the cache's CPU blocks (BufferStep's), the slots claimed; None: call `attend`."""
        return None

    def layer_done(self, layer: int) -> bool:
        """Whether every new token of `layer` has been attended."""
        return self._filled[layer] == self.end - self.start

    def write(self, layer: int, first: int, k: torch.Tensor, v: torch.Tensor) -> None:
        raise NotImplementedError

    def attend_written(self, layer: int, q: torch.Tensor, first: int) -> torch.Tensor:
        raise NotImplementedError


class BufferStep(CacheStep):
    """A step of a cache that keeps all its KV in device buffers k_buf, v_buf
    [L, B, Hkv, capacity, D]: the new tokens go to their slots and each query sees the slots
    before its own (and, with a sliding window, only the latest of them). The cache's `decoder`
    (`buffer_decoder`'s) takes the decoding steps it serves."""

    def __init__(self, cache, start: int, end: int, positions: torch.Tensor, record_queries: bool = False,
                 sliding_windows: tuple | None = None):
        super().__init__(start, end, positions, cache.k_buf.shape[0], record_queries)
        self.cache = cache
        self.sliding_windows = sliding_windows
        self.decoder = cache.decoder

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        slots = None
        if self.decoder is not None and self.decoder.takes_rows(q, k, v):  # straight over the buffers
            slots = self.kernel_slots(layer, q.dtype, *q.shape[:3])
        if slots is None:
            return super().attend(layer, q, k, v)
        decoder, first, keys, queries = slots
        if queries is not None:
            queries[layer] = q
        decoder.write(layer, first, k, v)
        return decoder.attend(layer, q, keys)

    def kernel_slots(self, layer: int, dtype: torch.dtype, batch: int, heads: int, tokens: int):
        """For a step whose queries, keys and values the cache's decoder takes as they come (on the
        CPU, in `dtype`): claims the `tokens` slots of `layer` and returns (decoder, first slot, keys
        seen, the per-layer list the queries go in or None), for the caller to write them and
        attend; else None."""
        decoder = self.decoder
        if decoder is None:
            return None
        first = self.start + self._filled[layer]
        keys = first + tokens
        window = self.sliding_windows[layer] if self.sliding_windows is not None else None
        if keys > self.end or not decoder.serves_step(dtype, batch, heads, tokens, keys, window):
            return None
        self._filled[layer] += tokens
        return decoder, first, keys, self.queries

    def write(self, layer: int, first: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.cache.k_buf[layer, :, :, first:first + k.shape[2]] = k
        self.cache.v_buf[layer, :, :, first:first + v.shape[2]] = v

    def attend_written(self, layer: int, q: torch.Tensor, first: int) -> torch.Tensor:
        c, hi = self.cache, first + q.shape[2]
        window = self.sliding_windows[layer] if self.sliding_windows is not None else None
        return c.attn.attend(q, c.k_buf[layer, :, :, :hi], c.v_buf[layer, :, :, :hi], scale=c.scale,
                             sliding_window=window)


def buffer_decoder(attn, k_buf: torch.Tensor, v_buf: torch.Tensor, scale: float):
    """What a BufferStep hands its decoding steps to: the attention backend's direct path over a
    cache's buffers (None where it has none). A cache makes it once, beside its buffers: its numpy
    views hold nothing the buffers do not."""
    make = getattr(attn, "buffer_decoder", None)
    return make(k_buf, v_buf, scale) if make is not None else None
