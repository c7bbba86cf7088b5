"""One forward pass over the offloaded full cache (triforce.cache.offloaded): new tokens' KV written
to the device or staged for the host, their queries attending over the resident keys, the host
blocks streamed by the prefetcher (or attended in place by the CPU) and themselves, merged by
log-sum-exp."""
from __future__ import annotations

import torch

from triforce.cache_contract import CacheStep
from triforce.kernels import PartialAccumulator, block_visible
from triforce.offload.prefetcher import TransferPlan

# an all-resident query group attends in one call when its [T, S] mask has at most this many
# elements; longer groups go through the tiled partial path, whose temporaries are bounded
ONE_SHOT_MASK_ELEMENTS = 1 << 25


class OffloadedCacheStep(CacheStep):
    """One forward pass over new tokens [start, end). In a layer-major prefill the model calls
    attend once per query group of a layer, in order; each call streams the layer's host blocks
    once, so a group as long as the prompt reads the host KV once per layer. `cache`: the
    cache.offloaded.OffloadedKVCache it runs over (which makes it: no import back)."""

    def __init__(self, cache, start: int, end: int, record_queries: bool, plan: TransferPlan,
                 prefill: bool = False, in_place: tuple[tuple[int, ...], ...] = ()):
        super().__init__(start, end, torch.arange(start, end, device=cache.device)[None], cache.num_layers,
                         record_queries)
        self.cache, self.plan, self.prefill = cache, plan, prefill
        self.in_place = in_place or tuple(() for _ in range(cache.num_layers))  # CPU-attended host blocks
        self._waited_writes = False
        self._scratch: tuple[torch.Tensor, torch.Tensor] | None = None  # this layer's host-bound new KV
        self._scratch_layer = -1
        self._buffers: tuple[torch.Tensor, torch.Tensor] | None = None  # _scratch's own storage (k, v)

    def write(self, layer: int, first: int, k: torch.Tensor, v: torch.Tensor) -> None:
        c = self.cache
        resident, last = c.resident_tokens, first + k.shape[2]
        if first < resident:
            split = min(last, resident)
            c.k_res[layer, :, :, first:split] = k[:, :, :split - first]
            c.v_res[layer, :, :, first:split] = v[:, :, :split - first]
        host_new_start = max(self.start, resident)
        if last > host_new_start:
            self._stage(layer, first, k, v, host_new_start)

    def attend_written(self, layer: int, q: torch.Tensor, q_start: int) -> torch.Tensor:
        c = self.cache
        resident, window = c.resident_tokens, c.sliding_windows[layer]
        q_end = q_start + q.shape[2]
        host_new_start = max(self.start, resident)
        if self.start <= resident and q_end <= resident and q.shape[2] * q_end <= ONE_SHOT_MASK_ELEMENTS:
            # everything resident and the mask small: one-shot attention
            return c.attn.attend(q, c.k_res[layer, :, :, :q_end], c.v_res[layer, :, :, :q_end], scale=c.scale,
                                 sliding_window=window)
        acc = PartialAccumulator()
        cpu_part = None
        if self.in_place[layer]:  # the CPU starts on its share while the device does the rest
            cpu_part = c.host_share(layer, q, self.in_place[layer], self.start, first=not self._waited_writes)
            self._waited_writes = True
        resident_end = min(q_end, resident)
        if resident_end > 0 and block_visible(q_start, q.shape[2], 0, resident_end, window):
            acc.add(*c.attn.partial(q, c.k_res[layer, :, :, :resident_end], c.v_res[layer, :, :, :resident_end],
                                    scale=c.scale, q_start=q_start, k_start=0, sliding_window=window))
        if c.ext_tokens and block_visible(q_start, q.shape[2], resident, c.device_tokens, window):
            acc.add(*c.attn.partial(q, c.k_ext[layer, :, :, :c.ext_tokens], c.v_ext[layer, :, :, :c.ext_tokens],
                                    scale=c.scale, q_start=q_start, k_start=resident, sliding_window=window))
        streamed = 0  # host KV bytes the device attends (the CPU's part is timed against them)
        for block, staged in c.prefetcher.read(self.plan, layer, again=not self.layer_done(layer)):
            first = c.store.block_start(block)
            k_old, v_old = c.store.block_kv(staged, min(c.store.block_tokens, self.start - first))
            streamed += k_old.nbytes + v_old.nbytes
            acc.add(*c.attn.partial(q, k_old, v_old, scale=c.scale, q_start=q_start, k_start=first,
                                    sliding_window=window))
        if cpu_part is not None:
            acc.add(*cpu_part(streamed))
        if q_end > host_new_start:
            scratch_k, scratch_v = self._scratch
            count = q_end - host_new_start
            acc.add(*c.attn.partial(q, scratch_k[:, :, :count], scratch_v[:, :, :count], scale=c.scale,
                                    q_start=q_start, k_start=host_new_start, sliding_window=window))
            if self.layer_done(layer):  # send the layer's KV home
                c.prefetcher.write(layer, host_new_start, scratch_k[:, :, :count], scratch_v[:, :, :count])
                if self.prefill:  # the retrieval tier's chunk means made here, not from the host later
                    c.summarize_home(layer, host_new_start, scratch_k[:, :, :count])
                else:  # a verify pass: keep its KV on the device for the sparse tiers
                    c.keep_recent(layer, host_new_start, scratch_k[:, :, :count], scratch_v[:, :, :count])
                self._scratch = None
        return acc.result(q.dtype)

    def _stage(self, layer: int, q_start: int, k: torch.Tensor, v: torch.Tensor, host_new_start: int) -> None:
        """Keep the host-bound part of the new k, v on the device until the layer is done."""
        total = self.end - host_new_start
        skip = max(host_new_start - q_start, 0)
        at = max(q_start, host_new_start) - host_new_start
        if q_start <= host_new_start and k.shape[2] - skip == total:  # one call covers all: no copy
            self._scratch = (k[:, :, skip:], v[:, :, skip:])
            return
        if self._scratch is None or self._scratch_layer != layer:
            if self._buffers is not None and self.prefill:  # the last layer's KV must have left for the host
                self.cache.prefetcher.wait_for_writes()
            else:  # once per prefill (a verify's stays with keep_recent; a verify seldom copies here)
                shape = (2, k.shape[0], k.shape[1], total, k.shape[3])
                self._buffers = torch.empty(shape, dtype=k.dtype, device=k.device).unbind()
            self._scratch, self._scratch_layer = self._buffers, layer
        self._scratch[0][:, :, at:at + k.shape[2] - skip] = k[:, :, skip:]
        self._scratch[1][:, :, at:at + v.shape[2] - skip] = v[:, :, skip:]
