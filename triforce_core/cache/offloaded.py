"""The full KV cache split between the device and the host.

Tokens [0, resident_tokens) of every layer stay in device buffers (k_res, v_res); later tokens
live in the host KV store. Attention of new queries is merged by log-sum-exp from the resident
keys, the host blocks streamed by the prefetcher and the new tokens themselves. New tokens' KV
goes home once its layer is done. It implements the FullCache contract (triforce.cache_contract).

Prefill runs layer-major (`layer_major`): one pass, one layer over all new tokens before the
next, its queries attending in large groups, so a layer's host-bound KV is written once (its
retrieval chunk means beside it, summarize_home) and its host blocks are streamed
once per group rather than once per prefill chunk.

Residency after prefill (`decode_resident_tokens`): the first short pass after a prefill copies
the first whole host blocks once into the room the prefill's device scratch leaves (`k_ext`,
`v_ext`); the host keeps them too: a prefill frees the copies, a rollback below them forgets them.

Hybrid (`hybrid`, offload.hybrid): in a pass of a few new tokens (decoding, a verify) the CPU
attends over the oldest share of each layer's host blocks in place (triforce.kernels.cpu.attention.host,
on a worker thread on CUDA) while the prefetcher streams the rest; the CPU's partial result merges
with the others by log-sum-exp; on a GPU the share follows the halves' measured times.

What sparse caches read from it (the FullCache contract's read side): chunk scores from mean keys
(resident chunks on the device, host chunks on the CPU), a layer's keys, a gather of selected
tokens, a range of recent tokens' KV. A pass is triforce.cache.offloaded_step."""
from __future__ import annotations

import torch

from triforce.cache.offloaded_step import OffloadedCacheStep
from triforce.kernels import SDPA, RetrievalKernels
from triforce.kernels.chunk_means import ChunkMeans
from triforce.kernels.retrieval import chunk_mean_keys
from triforce.kernels.cpu.attention.host import host_partial, takes as host_attention_takes, \
    warm_up as warm_host_attention
from triforce.offload.errors import OffloadError
from triforce.offload.hybrid import CpuWorker, HybridRates, ShareTuner, split_blocks
from triforce.offload.prefetcher import Prefetcher, TransferPlan
from triforce.offload.shapes import GATHER_GROUP_BYTES
from triforce.pinned import HostKVStore, allocate_host


MAX_HYBRID_TOKENS = 16  # passes of at most this many new tokens split their host KV (a prefill streams it)


class OffloadedKVCache:
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

    # ---- what sparse caches read (the FullCache contract's read side) -------------------
    def top_chunks(self, scores: torch.Tensor, k: int) -> torch.Tensor:
        return self.kernels.topk(scores, k)

    def chunk_scores(self, layer: int, query: torch.Tensor, chunk_size: int) -> torch.Tensor:
        """query [B, H, D] -> [B, Hkv, length // chunk_size], scored on the device: resident chunks
        from mean keys kept there, host chunks from mean keys kept on the host (made as a prefill
        sent them home, or from the host keys of chunks completed since) and copied over, a
        sixteenth of the keys or less: no query to the host and no scores back, no wait a layer."""
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
            self._host_chunk_means(layer, chunk_size, host_chunks)
            run = self._host_means[chunk_size].means_buf.permute(0, 3, 1, 2, 4)[layer, :host_chunks]  # contiguous
            means = run.to(self.device, non_blocking=True).permute(1, 2, 0, 3)  # pinned: no wait
            scores.append(self.kernels.scores(query, means.contiguous()))
        return torch.cat(scores, dim=-1)

    def expect_chunks(self, chunk_size: int) -> None:
        """A retrieval tier scores chunks of this size: a prefill's keys are averaged on the device
        as each layer goes home (summarize_home), so its rebuild never reads them back on the CPU."""
        self._host_means_of(chunk_size)

    def summarize_home(self, layer: int, start: int, keys: torch.Tensor) -> None:
        """keys [B, Hkv, n, D] (device) of host positions [start, start + n), on their way home: the
        means of the chunks they complete, made here and sent beside them."""
        for chunk_size, means in self._host_means.items():
            offset = start - self.resident_tokens
            first, count = offset // chunk_size, keys.shape[2] // chunk_size
            if offset % chunk_size or means.valid[layer] != first or not count:
                continue  # not the next whole chunks: averaged from the host when read (ChunkMeans.read)
            made = chunk_mean_keys(keys[:, :, :count * chunk_size], chunk_size).to(means.means_buf.dtype)
            self.prefetcher.send(means.means_buf.permute(0, 3, 1, 2, 4)[layer, first:first + count],
                                 made.permute(2, 0, 1, 3).contiguous())
            means.valid[layer] = first + count

    def rollback_means(self, length: int) -> None:
        """Tokens from `length` on are gone: so are the chunk means they completed."""
        for means in self._resident_means.values():
            means.rollback(length)
        for means in self._host_means.values():
            means.rollback(max(0, length - self.resident_tokens))

    def _host_means_of(self, chunk_size: int) -> ChunkMeans:
        if chunk_size not in self._host_means:
            # chunk-major, so a layer's run of chunks is one contiguous piece a device copy lands in
            chunks = (self.max_len - self.resident_tokens) // chunk_size  # the most the host ever holds
            shape = (self.num_layers, chunks, self.batch, self.kv_heads, self.k_res.shape[-1])
            (means,) = allocate_host([shape], self.k_res.dtype, what="host chunk means")
            self._host_means[chunk_size] = ChunkMeans(means.permute(0, 2, 3, 1, 4), chunk_size)
        return self._host_means[chunk_size]

    def _host_chunk_means(self, layer: int, chunk_size: int, count: int) -> torch.Tensor:
        """Mean keys [B, Hkv, count, D] (host) of the first `count` host chunks of `layer`."""
        means = self._host_means_of(chunk_size)
        self.prefetcher.synchronize()  # means sent from the device have landed (free when none was sent)
        return means.read(layer, count, lambda start, end: self._host_keys(layer, start, end))

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
        self._gather_group([(layer, index)], [(k_dst, v_dst)])

    def gather_layers(self, chosen: list[tuple[int, torch.Tensor]], k_buf: torch.Tensor, v_buf: torch.Tensor) -> None:
        """For each (layer, index [B, Hkv, N]): k_buf[layer, :, :, :N], v_buf[...] <- those tokens' keys
        and values. With host KV, the layers go in groups whose host staging fits GATHER_GROUP_BYTES:
        one wait a group for their indices (a layer at a time, a rebuild waited once a layer)."""
        dsts = [(k_buf[layer, :, :, :index.shape[-1]], v_buf[layer, :, :, :index.shape[-1]]) for layer, index in chosen]
        if not chosen:
            return
        per_layer = 2 * chosen[0][1].numel() * self.k_res.shape[-1] * self.k_res.element_size()
        group = max(1, GATHER_GROUP_BYTES // per_layer)
        for first in range(0, len(chosen), group):
            self._gather_group(chosen[first:first + group], dsts[first:first + group])

    def _gather_group(self, chosen: list[tuple[int, torch.Tensor]], dsts: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Keys and values of `chosen` layers' indices into `dsts` on the device; host entries are
        gathered by the numba kernel into a host staging buffer, then copied over."""
        if self.length <= self.resident_tokens:  # all resident: the device kernel, no host round trip
            for (layer, index), (k_dst, v_dst) in zip(chosen, dsts):
                self.kernels.gather_into(self.k_res[layer], self.v_res[layer], index, k_dst, v_dst)
            return
        self.prefetcher.synchronize()
        # the one wait of a group: it also orders every earlier copy out of the staging buffer (on
        # this stream) before the CPU writes it again or a larger one replaces it
        same = len({tuple(index.shape) for _, index in chosen}) == 1
        host_indices = (torch.stack([index for _, index in chosen]).to("cpu") if same
                        else [index.to("cpu") for _, index in chosen])
        per = max(index.numel() for _, index in chosen) * self.k_res.shape[-1]
        numel = per * len(chosen)
        if not self._gather_staging or self._gather_staging[0].numel() < numel:
            self._gather_staging = allocate_host([(numel,), (numel,)], self.k_res.dtype,
                                                 what="the retrieval staging buffer")
        resident = self.resident_tokens
        for i, ((layer, index), (k_dst, v_dst)) in enumerate(zip(chosen, dsts)):
            shape = (*index.shape, self.k_res.shape[-1])
            size = index.numel() * self.k_res.shape[-1]
            host_k, host_v = (t[i * per:i * per + size].view(shape) for t in self._gather_staging)
            self.store.gather(layer, host_indices[i], host_k, host_v)
            host_k, host_v = host_k.to(self.device, non_blocking=True), host_v.to(self.device, non_blocking=True)
            if not resident:
                k_dst.copy_(host_k)
                v_dst.copy_(host_v)
                continue
            expanded = index.clamp(max=resident - 1)[..., None].expand(-1, -1, -1, self.k_res.shape[-1])
            on_host = (index >= resident)[..., None]
            k_dst.copy_(torch.where(on_host, host_k, torch.gather(self.k_res[layer], 2, expanded)))
            v_dst.copy_(torch.where(on_host, host_v, torch.gather(self.v_res[layer], 2, expanded)))

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
