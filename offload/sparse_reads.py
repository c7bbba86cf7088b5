"""What sparse caches read from the offloaded full cache (the FullCache contract's read side):
chunk scores from mean keys (resident chunks on the device, host chunks on the CPU), the keys of
a layer, a gather of selected tokens, and a range of recent tokens' KV. A part of
OffloadedKVCache, kept apart so each file stays readable; the state it reads is declared below and
made by OffloadedKVCache.__init__."""
from __future__ import annotations

import torch

from triforce.kernels import RetrievalKernels
from triforce.kernels.chunk_means import ChunkMeans
from triforce.kernels.retrieval import chunk_mean_keys
from triforce.offload.errors import OffloadError
from triforce.offload.prefetcher import Prefetcher
from triforce.offload.shapes import GATHER_GROUP_BYTES
from triforce.pinned import HostKVStore, allocate_host


class SparseReads:
    # the offloaded cache's state this half reads (OffloadedKVCache.__init__ makes it)
    device: torch.device
    length: int  # tokens cached
    max_len: int
    resident_tokens: int  # the first ones, in k_res/v_res on the device; the rest in the host store
    num_layers: int
    batch: int
    kv_heads: int
    k_res: torch.Tensor  # [layers, batch, kv_heads, resident_tokens, head_dim]
    v_res: torch.Tensor
    store: HostKVStore
    prefetcher: Prefetcher
    kernels: RetrievalKernels
    _resident_means: dict[int, ChunkMeans]  # by chunk size
    _host_means: dict[int, ChunkMeans]
    _gather_staging: list[torch.Tensor]  # flat host buffers for retrieval gathers
    _recent: dict[int, tuple[int, torch.Tensor, torch.Tensor]]  # layer -> (start, k, v) of this pass

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
