"""The full KV cache split between the device and the host.

Tokens [0, resident_tokens) of every layer stay in device buffers (k_res, v_res); later tokens
live in the host KV store. Attention of new queries is merged by log-sum-exp from three parts:
the resident keys, the host blocks streamed by the prefetcher, and the new tokens themselves.
New tokens' KV goes to its home once its layer is done. It implements the FullCache contract
(triforce.cache_contract), so the engine does not know the difference.

Prefill runs layer-major (`layer_major`): one pass, one layer over all new tokens before the
next, its queries attending in large groups, so a layer's host-bound KV is written once and its
host blocks are streamed once per group rather than once per prefill chunk."""
from __future__ import annotations

import torch

from triforce.cache_contract import CacheStep
from triforce.kernels import SDPA, TORCH_KERNELS, PartialAccumulator, RetrievalKernels, block_visible
from triforce.kernels.chunk_means import ChunkMeans
from triforce.offload.errors import OffloadError
from triforce.offload.prefetcher import Prefetcher, TransferPlan
from triforce.pinned import HostKVStore, allocate_host


# an all-resident query group attends in one call when its [T, S] mask has at most this many
# elements; longer groups go through the tiled partial path, whose temporaries are bounded
ONE_SHOT_MASK_ELEMENTS = 1 << 25


class OffloadedKVCache:
    layer_major = True

    def __init__(self, cfg, max_len: int, resident_tokens: int, block_tokens: int, *,
                 dtype: torch.dtype, device: torch.device | str, batch: int = 1, overlap: bool = True,
                 pin: bool = True, host_budget_bytes: int | None = None, attn=SDPA, streams=None):
        if not 0 <= resident_tokens < max_len:
            raise OffloadError(f"resident tokens ({resident_tokens}) must be below the context ({max_len})")
        self.device = torch.device(device)
        self.attn = attn  # attention backend (triforce.kernels.select_attention)
        self.max_len, self.length = max_len, 0
        self.resident_tokens = resident_tokens
        self.num_layers, self.batch, self.kv_heads = cfg.num_layers, batch, cfg.num_kv_heads
        self.scale = cfg.head_dim ** -0.5
        self.sliding_windows = cfg.sliding_windows
        shape = (cfg.num_layers, batch, cfg.num_kv_heads, resident_tokens, cfg.head_dim)
        self.k_res = torch.zeros(shape, dtype=dtype, device=self.device)
        self.v_res = torch.zeros(shape, dtype=dtype, device=self.device)
        self.store = HostKVStore(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, max_len - resident_tokens,
                                 block_tokens, first_position=resident_tokens, dtype=dtype, batch=batch,
                                 pin=pin, budget_bytes=host_budget_bytes)
        self.prefetcher = Prefetcher(self.store, self.device, overlap=overlap, streams=streams)
        self.kernels = RetrievalKernels.for_device(self.device)
        # by chunk size: mean keys of resident chunks (device) and of host chunks (host, store positions)
        self._resident_means: dict[int, ChunkMeans] = {}
        self._host_means: dict[int, ChunkMeans] = {}
        self._gather_staging: list[torch.Tensor] = []  # flat host buffers for retrieval gathers
        # the last short pass's host-bound KV, still on the device per layer: (first position, k, v);
        # kv_range serves the newly committed tokens from here instead of reading the host back
        self._recent: dict[int, tuple[int, torch.Tensor, torch.Tensor]] = {}

    # ---- bookkeeping --------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        """Device bytes: resident KV (and its chunk means) plus staging buffers."""
        means = sum(m.nbytes for m in self._resident_means.values())
        return self.k_res.nbytes + self.v_res.nbytes + means + self.prefetcher.staging_bytes

    @property
    def host_nbytes(self) -> int:
        means = sum(m.nbytes for m in self._host_means.values())
        staging = sum(t.nbytes for t in self._gather_staging)
        return self.store.nbytes + means + staging

    def step(self, num_new: int, record_queries: bool = False, prefill: bool = False) -> "OffloadedCacheStep":
        if self.length + num_new > self.max_len:
            raise OffloadError(f"context full: {self.length} + {num_new} tokens exceed the cache's "
                               f"{self.max_len} slots")
        start = self.length
        self.length += num_new
        self._recent = {}  # this pass rewrites the positions they held
        return OffloadedCacheStep(self, start, self.length, record_queries, self.transfer_plan(start), prefill)

    def rollback(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot roll back to {length}: cache holds {self.length}")
        self.length = length
        self._recent = {layer: r for layer, r in self._recent.items() if r[0] < length}
        for means in self._resident_means.values():
            means.rollback(length)
        for means in self._host_means.values():
            means.rollback(max(0, length - self.resident_tokens))

    def prepare_verify(self) -> None:
        """Start copying the first host blocks of the next pass while the drafting tiers run."""
        self.prefetcher.prefetch(self.transfer_plan(self.length))

    def transfer_plan(self, start: int) -> TransferPlan:
        """The host blocks a pass whose new tokens begin at `start` reads: in every layer, those
        holding old tokens [resident, start) that some query of the pass may see."""
        return TransferPlan(tuple(tuple(self._host_blocks(layer, start)) for layer in range(self.num_layers)))

    def _host_blocks(self, layer: int, start: int) -> range:
        first_visible = self.resident_tokens
        window = self.sliding_windows[layer]
        if window is not None:
            first_visible = max(first_visible, start - window + 1)
        if start <= first_visible:
            return range(0)
        bt = self.store.block_tokens
        return range((first_visible - self.resident_tokens) // bt, (start - 1 - self.resident_tokens) // bt + 1)

    # ---- the read interface of sparse caches --------------------------------------------
    def chunk_scores(self, layer: int, query: torch.Tensor, chunk_size: int) -> torch.Tensor:
        """query [B, H, D] -> [B, Hkv, length // chunk_size]. Resident chunks are scored on the
        device; host chunks on the CPU from mean keys kept on the host and updated only for chunks
        completed since the last call."""
        if self.resident_tokens % chunk_size or self.store.block_tokens % chunk_size:
            raise OffloadError(f"--chunk-size {chunk_size} must divide the offload alignment "
                               f"({self.store.block_tokens} tokens); use a power of two up to 256")
        num_chunks = self.length // chunk_size
        resident_chunks = min(num_chunks, self.resident_tokens // chunk_size)
        if chunk_size not in self._resident_means:
            self._resident_means[chunk_size] = ChunkMeans.like(self.k_res, chunk_size)
        keys = self.k_res[layer]
        means = self._resident_means[chunk_size].read(layer, resident_chunks, lambda start, end: keys[:, :, start:end])
        scores = [self.kernels.scores(query, means)]
        host_chunks = num_chunks - resident_chunks
        if host_chunks > 0:
            means = self._host_chunk_means(layer, chunk_size, host_chunks)
            scores.append(TORCH_KERNELS.scores(query.to("cpu"), means).to(self.device, scores[0].dtype))
        return torch.cat(scores, dim=-1)

    def _host_chunk_means(self, layer: int, chunk_size: int, count: int) -> torch.Tensor:
        """Mean keys [B, Hkv, count, D] (host) of the first `count` host chunks of `layer`."""
        if chunk_size not in self._host_means:
            shape = (self.num_layers, self.batch, self.kv_heads, self.store.capacity // chunk_size,
                     self.k_res.shape[-1])
            (means,) = allocate_host([shape], self.k_res.dtype, pin=False, what="host chunk means")
            self._host_means[chunk_size] = ChunkMeans(means, chunk_size)
        return self._host_means[chunk_size].read(layer, count, lambda start, end: self._host_keys(layer, start, end))

    def _host_keys(self, layer: int, start: int, end: int) -> torch.Tensor:
        """Keys [B, Hkv, end - start, D] of host positions [start, end) (counted from the store's first)."""
        self.prefetcher.synchronize()  # host writes of recent tokens must have landed
        bt = self.store.block_tokens
        first, last = start // bt, (end - 1) // bt
        keys = torch.cat([self.store.keys_of_block(layer, block) for block in range(first, last + 1)], dim=2)
        return keys[:, :, start - first * bt:end - first * bt]

    def keys(self, layer: int) -> torch.Tensor:
        """Keys [B, Hkv, length, D] of every token of `layer` on the device, the host part copied
        over (for the top-k policy, an oracle that reads every key anyway)."""
        resident = min(self.length, self.resident_tokens)
        parts = [self.k_res[layer, :, :, :resident]]
        if self.length > resident:
            parts.append(self._host_keys(layer, 0, self.length - resident).to(self.device))
        return torch.cat(parts, dim=2)

    def gather_into(self, layer: int, index: torch.Tensor, k_dst: torch.Tensor, v_dst: torch.Tensor) -> None:
        """index [B, Hkv, N] (device) -> k_dst, v_dst [B, Hkv, N, D]: the keys and values of those tokens."""
        if self.length <= self.resident_tokens:  # all resident: the device kernel, no host round trip
            self.kernels.gather_into(self.k_res[layer], self.v_res[layer], index, k_dst, v_dst)
            return
        k, v = self._gather_with_host(layer, index)
        k_dst.copy_(k)
        v_dst.copy_(v)

    def _gather_with_host(self, layer: int, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [B, Hkv, N, D] on the device; host entries are gathered by the numba
        kernel into a host staging buffer, then copied over."""
        resident = self.resident_tokens
        expanded = index.clamp(max=max(resident - 1, 0))[..., None].expand(-1, -1, -1, self.k_res.shape[-1])
        if resident:
            k = torch.gather(self.k_res[layer], 2, expanded)
            v = torch.gather(self.v_res[layer], 2, expanded)
        else:
            k = v = None
        self.prefetcher.synchronize()
        shape = (self.batch, self.kv_heads, index.shape[-1], self.k_res.shape[-1])
        numel = shape[0] * shape[1] * shape[2] * shape[3]
        if not self._gather_staging or self._gather_staging[0].numel() < numel:
            self._gather_staging = allocate_host([(numel,), (numel,)], self.k_res.dtype,
                                                 what="the retrieval staging buffer")
        host_k, host_v = (t[:numel].view(shape) for t in self._gather_staging)
        self.store.gather(layer, index.to("cpu"), host_k, host_v)
        host_k, host_v = host_k.to(self.device), host_v.to(self.device)
        if k is None:
            return host_k, host_v
        on_host = (index >= resident)[..., None]
        return torch.where(on_host, host_k, k), torch.where(on_host, host_v, v)

    def kv_range(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [L, B, Hkv, end - start, D] of tokens [start, end) on the device."""
        split = min(max(start, self.resident_tokens), end)
        parts_k, parts_v = [self.k_res[:, :, :, start:split]], [self.v_res[:, :, :, start:split]]
        recent = self._recent_range(split, end)
        if recent is not None:  # no wait for the copy stream, no copy back from the host
            parts_k.append(recent[0])
            parts_v.append(recent[1])
        elif end > split:
            self.prefetcher.synchronize()
            host_k, host_v = self.store.read(split, end)
            parts_k.append(host_k.to(self.device))
            parts_v.append(host_v.to(self.device))
        return torch.cat(parts_k, dim=3), torch.cat(parts_v, dim=3)

    def _recent_range(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Tokens [start, end) of every layer from the last pass's device copies, if all have them."""
        if end <= start or len(self._recent) < self.num_layers:
            return None
        for first, k, _ in self._recent.values():
            if not first <= start or end > first + k.shape[2]:
                return None
        layers = [self._recent[layer] for layer in range(self.num_layers)]
        return (torch.stack([k[:, :, start - first:end - first] for first, k, _ in layers]),
                torch.stack([v[:, :, start - first:end - first] for first, _, v in layers]))


class OffloadedCacheStep(CacheStep):
    """One forward pass over new tokens [start, end). In a layer-major prefill the model calls
    attend once per query group of a layer, in order; each call streams the layer's host blocks
    once, so a group as long as the prompt reads the host KV once per layer."""

    def __init__(self, cache: OffloadedKVCache, start: int, end: int, record_queries: bool, plan: TransferPlan,
                 prefill: bool = False):
        super().__init__(start, end, torch.arange(start, end, device=cache.device)[None], cache.num_layers,
                         record_queries)
        self.cache, self.plan, self.prefill = cache, plan, prefill
        self._scratch: tuple[torch.Tensor, torch.Tensor] | None = None  # this layer's host-bound new KV
        self._scratch_layer = -1

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
        resident_end = min(q_end, resident)
        if resident_end > 0 and block_visible(q_start, q.shape[2], 0, resident_end, window):
            acc.add(*c.attn.partial(q, c.k_res[layer, :, :, :resident_end], c.v_res[layer, :, :, :resident_end],
                                    scale=c.scale, q_start=q_start, k_start=0, sliding_window=window))
        for block, staged in c.prefetcher.read(self.plan, layer, again=not self.layer_done(layer)):
            first = c.store.block_start(block)
            k_old, v_old = c.store.block_kv(staged, min(c.store.block_tokens, self.start - first))
            acc.add(*c.attn.partial(q, k_old, v_old, scale=c.scale, q_start=q_start, k_start=first,
                                    sliding_window=window))
        if q_end > host_new_start:
            scratch_k, scratch_v = self._scratch
            count = q_end - host_new_start
            acc.add(*c.attn.partial(q, scratch_k[:, :, :count], scratch_v[:, :, :count], scale=c.scale,
                                    q_start=q_start, k_start=host_new_start, sliding_window=window))
            if self.layer_done(layer):  # send the layer's KV home
                c.prefetcher.write(layer, host_new_start, scratch_k[:, :, :count], scratch_v[:, :, :count])
                if not self.prefill:  # a verify pass: keep its KV on the device for the sparse tiers
                    c._recent[layer] = (host_new_start, scratch_k[:, :, :count], scratch_v[:, :, :count])
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
            shape = (k.shape[0], k.shape[1], total, k.shape[3])
            # a fresh buffer per layer: the previous layer's may still be on its way to the host
            self._scratch = (torch.empty(shape, dtype=k.dtype, device=k.device),
                             torch.empty(shape, dtype=v.dtype, device=v.device))
            self._scratch_layer = layer
        self._scratch[0][:, :, at:at + k.shape[2] - skip] = k[:, :, skip:]
        self._scratch[1][:, :, at:at + v.shape[2] - skip] = v[:, :, skip:]
