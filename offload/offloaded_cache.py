"""The full KV cache split between the device and the host.

Tokens [0, resident_tokens) of every layer stay in device buffers (k_res, v_res); later tokens
live in the host KV store. Attention of new queries is merged by log-sum-exp from the resident
keys, the host blocks streamed by the prefetcher and the new tokens themselves. New tokens' KV
goes home once its layer is done. It implements the FullCache contract (triforce.cache_contract).

Prefill runs layer-major (`layer_major`): one pass, one layer over all new tokens before the
next, its queries attending in large groups, so a layer's host-bound KV is written once (its
retrieval chunk means beside it, SparseReads.summarize_home) and its host blocks are streamed
once per group rather than once per prefill chunk.

Residency after prefill (`decode_resident_tokens`): the first short pass after a prefill copies
the first whole host blocks once into the room the prefill's device scratch leaves (`k_ext`,
`v_ext`); the host keeps them too: a prefill frees the copies, a rollback below them forgets them.

Hybrid (`hybrid`, offload.hybrid): in a pass of a few new tokens (decoding, a verify) the CPU
attends over the oldest share of each layer's host blocks in place (triforce.kernels.cpu.attention.host,
on a worker thread on CUDA) while the prefetcher streams the rest; the CPU's partial result merges
with the others by log-sum-exp; on a GPU the share follows the halves' measured times."""
from __future__ import annotations

import torch

from triforce.cache_contract import CacheStep
from triforce.kernels import SDPA, PartialAccumulator, RetrievalKernels, block_visible
from triforce.kernels.chunk_means import ChunkMeans
from triforce.kernels.cpu.attention.host import host_partial, takes as host_attention_takes, \
    warm_up as warm_host_attention
from triforce.offload.errors import OffloadError
from triforce.offload.hybrid import CpuWorker, HybridRates, ShareTuner, split_blocks
from triforce.offload.prefetcher import Prefetcher, TransferPlan
from triforce.offload.sparse_reads import SparseReads
from triforce.pinned import HostKVStore


# an all-resident query group attends in one call when its [T, S] mask has at most this many
# elements; longer groups go through the tiled partial path, whose temporaries are bounded
ONE_SHOT_MASK_ELEMENTS = 1 << 25
MAX_HYBRID_TOKENS = 16  # passes of at most this many new tokens split their host KV (a prefill streams it)


class OffloadedKVCache(SparseReads):
    layer_major = True

    def __init__(self, cfg, max_len: int, resident_tokens: int, block_tokens: int, *,
                 dtype: torch.dtype, device: torch.device | str, batch: int = 1, overlap: bool = True,
                 pin: bool = True, host_budget_bytes: int | None = None, attn=SDPA, streams=None,
                 hybrid: HybridRates | float | None = None, decode_resident_tokens: int = 0, host_arena=None):
        """hybrid: the rates that split a short pass's host blocks between PCIe and the CPU, or a
        fixed CPU share (tests); None: every host block is streamed. decode_resident_tokens: KV
        tokens the device may hold once prefill is done (the plan's; at most resident_tokens:
        none move). host_arena: host bytes the store borrows (triforce.pinned.HostArena)."""
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
                                 pin=pin, budget_bytes=host_budget_bytes, arena=host_arena)
        self.prefetcher = Prefetcher(self.store, self.device, overlap=overlap, streams=streams)
        self.kernels = RetrievalKernels.for_device(self.device)
        # by chunk size: mean keys of resident chunks (device) and of host chunks (host, store positions)
        self._resident_means: dict[int, ChunkMeans] = {}
        self._host_means: dict[int, ChunkMeans] = {}
        self._gather_staging: list[torch.Tensor] = []  # flat host buffers for retrieval gathers
        # the last short pass's host-bound KV, still on the device per layer: (first position, k, v);
        # kv_range serves the newly committed tokens from here instead of reading the host back
        self._recent: dict[int, tuple[int, torch.Tensor, torch.Tensor]] = {}
        self.hybrid = hybrid if host_attention_takes(dtype) else None
        if self.hybrid is not None:  # compile before the first pass, not during it
            warm_host_attention(dtype, cfg.num_kv_heads, cfg.head_dim)
        self._last_tokens = 1  # the last short pass's new tokens: the next prefetch's split
        self.cpu_worker = CpuWorker(self.device, self.prefetcher.streams)
        self.tuner = ShareTuner(hybrid, self.prefetcher.streams) if isinstance(self.hybrid, HybridRates) else None
        self.cpu_bytes = 0     # host KV bytes attended in place (not streamed)
        # device copies of host positions [resident_tokens, resident_tokens + ext_tokens), whole blocks
        self.ext_capacity = max(0, decode_resident_tokens - resident_tokens) // block_tokens * block_tokens
        self.k_ext = self.v_ext = None
        self.ext_tokens = 0

    # ---- bookkeeping --------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        """Device bytes: resident KV (and its chunk means) plus staging buffers."""
        means = sum(m.nbytes for m in self._resident_means.values())
        ext = 2 * self.k_ext.nbytes if self.k_ext is not None else 0
        return self.k_res.nbytes + self.v_res.nbytes + ext + means + self.prefetcher.staging_bytes

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
        if prefill:
            self._free_ext()  # the prefill's scratch is where the copies were
        else:
            self.promote(start)
        self.length += num_new
        self._recent = {}  # this pass rewrites the positions they held
        if not prefill and num_new <= MAX_HYBRID_TOKENS:
            self._last_tokens = num_new
        in_place, streamed = self._split(start, num_new, prefill)
        return OffloadedCacheStep(self, start, self.length, record_queries, streamed, prefill, in_place)

    def keep_recent(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Keep a verify pass's new host-bound KV of `layer` (from `start`) on the device too: the
        sparse tiers read it from here until the next pass instead of over PCIe."""
        self._recent[layer] = (start, k, v)

    def rollback(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot roll back to {length}: cache holds {self.length}")
        self.length = length
        self._recent = {layer: r for layer, r in self._recent.items() if r[0] < length}
        # copies of blocks the next pass may rewrite are forgotten (the host still holds them)
        bt = self.store.block_tokens
        self.ext_tokens = min(self.ext_tokens, max(0, length - self.resident_tokens) // bt * bt)
        self.rollback_means(length)

    def prepare_verify(self) -> None:
        """Start copying the first streamed host blocks of the next pass while the drafting tiers
        run (split as the last short pass was: the same number of new tokens is likeliest)."""
        self.prefetcher.prefetch(self._split(self.length, self._last_tokens, False)[1])

    def promote(self, start: int) -> None:
        """Copy the whole host blocks filled before `start` into the device's room for them
        (once; a rollback may have forgotten some, which are copied again)."""
        bt = self.store.block_tokens
        want = min(self.ext_capacity, max(0, start - self.resident_tokens) // bt * bt)
        if want <= self.ext_tokens:
            return
        if self.k_ext is None:
            shape = (*self.k_res.shape[:3], self.ext_capacity, self.k_res.shape[-1])
            self.k_ext = torch.empty(shape, dtype=self.k_res.dtype, device=self.device)
            self.v_ext = torch.empty_like(self.k_ext)
        self.prefetcher.synchronize()  # the prefill's last writes have reached the host
        for layer in range(self.num_layers):
            for block in range(self.ext_tokens // bt, want // bt):
                k, v = self.store.block_kv(self.store.block(layer, block).to(self.device, non_blocking=True), bt)
                self.k_ext[layer, :, :, block * bt:(block + 1) * bt] = k
                self.v_ext[layer, :, :, block * bt:(block + 1) * bt] = v
        self.ext_tokens = want

    def _free_ext(self) -> None:
        self.k_ext = self.v_ext = None
        self.ext_tokens = 0

    @property
    def device_tokens(self) -> int:
        """Old tokens [0, device_tokens) attend from device memory; later ones from the host."""
        return self.resident_tokens + self.ext_tokens

    def transfer_plan(self, start: int) -> TransferPlan:
        """The host blocks a pass whose new tokens begin at `start` reads: in every layer, those
        holding old tokens [device_tokens, start) that some query of the pass may see; only the
        filled part of the last one is copied."""
        blocks = tuple(tuple(self._host_blocks(layer, start)) for layer in range(self.num_layers))
        return TransferPlan(blocks, filled=start - self.store.first_position)

    def cpu_share(self, num_new: int, prefill: bool = False) -> float:
        """The share of a pass's host blocks the CPU attends in place."""
        if self.hybrid is None or prefill or num_new > MAX_HYBRID_TOKENS:
            return 0.0
        return self.hybrid if isinstance(self.hybrid, float) else self.tuner.share(num_new)

    def _split(self, start: int, num_new: int, prefill: bool) -> tuple[tuple[tuple[int, ...], ...], TransferPlan]:
        """(the blocks the CPU attends in place per layer, the plan of the streamed ones)."""
        share = self.cpu_share(num_new, prefill)
        whole = self.transfer_plan(start)
        if share == 0.0:
            return tuple(() for _ in whole.blocks), whole
        halves = [((), blocks) if self.sliding_windows[layer] is not None else split_blocks(blocks, share)
                  for layer, blocks in enumerate(whole.blocks)]
        return tuple(h[0] for h in halves), TransferPlan(tuple(h[1] for h in halves), filled=whole.filled)

    def host_share(self, layer: int, q: torch.Tensor, blocks: tuple[int, ...], start: int, first: bool):
        """Start the CPU's attention of `q` over host `blocks` of `layer` (keys before `start`);
        returns a function giving its (out, lse) on the device. first: the pass's first such call,
        which waits for the earlier passes' writes to reach the host."""
        if first:
            self.prefetcher.synchronize()
        counts = [min(self.store.block_tokens, start - self.store.block_start(b)) for b in blocks]
        self.cpu_bytes += (cpu_bytes := sum(counts) * self.store.data[layer, 0, 0].nbytes)
        return self.cpu_worker.start(host_partial, q, self.store.data[layer], list(blocks), counts, scale=self.scale,
                                     tuner=self.tuner, cpu_bytes=cpu_bytes)

    def _host_blocks(self, layer: int, start: int) -> range:
        first_visible = self.device_tokens
        window = self.sliding_windows[layer]
        if window is not None:
            first_visible = max(first_visible, start - window + 1)
        if start <= first_visible:
            return range(0)
        bt = self.store.block_tokens
        origin = self.store.first_position
        return range((first_visible - origin) // bt, (start - 1 - origin) // bt + 1)

class OffloadedCacheStep(CacheStep):
    """One forward pass over new tokens [start, end). In a layer-major prefill the model calls
    attend once per query group of a layer, in order; each call streams the layer's host blocks
    once, so a group as long as the prompt reads the host KV once per layer."""

    def __init__(self, cache: OffloadedKVCache, start: int, end: int, record_queries: bool, plan: TransferPlan,
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
