"""The prefetcher: every stream, event and staging buffer of the offloaded KV lives here.

A pass over the offloaded cache comes with a `TransferPlan`: which host blocks of which layers it
reads, in order, computed once by the cache. Host KV blocks reach the device through staging
buffers on one copy stream. In the overlapped schedule there are two buffers: while attention runs
over block i, the plan's next block (the next of the layer, or the first of a later layer) is
already being copied, and before a verify pass the plan's first blocks are copied while the
drafting tiers run. The plain schedule has one buffer and copies each block on the compute stream
just before it is used; tests compare the two. New tokens' KV goes back to the host on the same
copy stream, so a later read of the same block can never overtake the write.

Streams and events are spoken through a `SyncStreams`-like interface (triforce.offload.streams):
CUDA streams on a GPU, program order on a CPU, a checked fake in tests.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch

from triforce.offload.streams import SyncStreams, streams_for
from triforce.pinned import HostKVStore


@dataclass(frozen=True)
class TransferPlan:
    """blocks[layer]: the host block indices one pass reads in that layer, in reading order.
    filled: host tokens (from the store's first position) the pass may see; a block past it
    is copied only up to it (None: whole blocks)."""
    blocks: tuple[tuple[int, ...], ...]
    filled: int | None = None

    def tokens(self, block: int, block_tokens: int) -> int:
        """Tokens of `block` to copy."""
        if self.filled is None:
            return block_tokens
        return max(0, min(block_tokens, self.filled - block * block_tokens))

    def order(self) -> list[tuple[int, int]]:
        return [(layer, block) for layer, blocks in enumerate(self.blocks) for block in blocks]

    def after(self, layer: int, i: int, again: bool = False) -> tuple[int, int] | None:
        """The read that follows the i-th block of `layer` (layer -1: the pass's first read);
        again: the layer is read once more next (another query group of a layer-major pass)."""
        if layer >= 0 and i + 1 < len(self.blocks[layer]):
            return layer, self.blocks[layer][i + 1]
        if again:
            return layer, self.blocks[layer][0]
        for later in range(layer + 1, len(self.blocks)):
            if self.blocks[later]:
                return later, self.blocks[later][0]
        return None


@dataclass
class TransferStats:
    h2d_bytes: int = 0
    d2h_bytes: int = 0
    blocks_copied: int = 0
    hits: int = 0      # reads served by a block copied ahead of time
    misses: int = 0    # reads that had to start their copy on demand


class Prefetcher:
    def __init__(self, store: HostKVStore, device: torch.device, *, overlap: bool = True,
                 streams: SyncStreams | None = None):
        self.store = store
        self.device = torch.device(device)
        self.overlap = overlap
        self.streams = streams if streams is not None else streams_for(self.device)
        num_buffers = 2 if overlap else 1
        shape = store.block(0, 0).shape
        self.staging_buf = [torch.empty(shape, dtype=store.data.dtype, device=self.device)
                            for _ in range(num_buffers)]
        self.copy_stream = self.streams.stream()
        self._writes_pending = False  # a write to the host issued since the last synchronize
        self._written = self.streams.event()  # the last write has read its source
        self._ready = [self.streams.event() for _ in range(num_buffers)]   # copy into buffer done
        self._free = [self.streams.event() for _ in range(num_buffers)]    # compute done reading buffer
        self._holds: list[tuple | None] = [None] * num_buffers            # (layer, block, version)
        self._versions: dict[tuple[int, int], int] = {}
        self.stats = TransferStats()

    @property
    def staging_bytes(self) -> int:
        return sum(b.nbytes for b in self.staging_buf)

    def _key(self, layer: int, block: int, tokens: int) -> tuple:
        return layer, block, self._versions.get((layer, block), 0), tokens

    # ---- reads --------------------------------------------------------------------------
    def read(self, plan: TransferPlan, layer: int, again: bool = False) -> Iterator[tuple[int, torch.Tensor]]:
        """Yield (block index, staging buffer [block_tokens, 2, B, Hkv, D]) for each block `plan`
        reads in `layer`. A buffer is valid until the next item is requested. again: the next
        read is this layer once more (so its first block is the one to fetch ahead)."""
        bt = self.store.block_tokens
        for i, block in enumerate(plan.blocks[layer]):
            tokens = plan.tokens(block, bt)
            if not self.overlap:
                self._copy_in_order(layer, block, tokens)
                self.stats.misses += 1
                yield block, self.staging_buf[0]
                continue
            upcoming = plan.after(layer, i, again)
            if upcoming is not None:
                upcoming = (*upcoming, plan.tokens(upcoming[1], bt))
            slot = self._held(layer, block, tokens)
            if slot is None:
                slot = self._issue(layer, block, tokens, avoid=self._held(*upcoming) if upcoming else None)
                self.stats.misses += 1
            else:
                self.stats.hits += 1
            if upcoming is not None and self._held(*upcoming) is None:
                self._issue(*upcoming, avoid=slot)
            self._wait_ready(slot)
            yield block, self.staging_buf[slot]
            self._release(slot)

    def prefetch(self, plan: TransferPlan) -> None:
        """Start copying the plan's first two blocks (called before drafting)."""
        if not self.overlap:
            return
        first = plan.after(-1, 0)
        if first is None:
            return
        second = plan.after(first[0], 0)
        bt = self.store.block_tokens
        first = (*first, plan.tokens(first[1], bt))
        second = (*second, plan.tokens(second[1], bt)) if second is not None else None
        slot = self._held(*first)
        if slot is None:
            slot = self._issue(*first, avoid=self._held(*second) if second is not None else None)
        if second is not None and self._held(*second) is None:
            self._issue(*second, avoid=slot)

    def _wait_ready(self, slot: int) -> None:
        """The compute stream waits for the copy into `slot`, right before reading it."""
        self.streams.wait_event(self.streams.current(), self._ready[slot])

    def _release(self, slot: int) -> None:
        """The compute stream is done with `slot` once its queued reads have run."""
        self.streams.record(self._free[slot], self.streams.current())

    def _held(self, layer: int, block: int, tokens: int) -> int | None:
        key = self._key(layer, block, tokens)
        for slot, held in enumerate(self._holds):
            if held == key:
                return slot
        return None

    def _issue(self, layer: int, block: int, tokens: int, avoid: int | None) -> int:
        """Copy the first `tokens` of a block into a buffer other than `avoid` on the copy stream."""
        slot = next(s for s in range(len(self.staging_buf)) if s != avoid)
        source, target = self.store.block(layer, block)[:tokens], self.staging_buf[slot][:tokens]
        self.streams.wait_event(self.copy_stream, self._free[slot])  # its last reader is done
        with self.streams.on(self.copy_stream):
            self.streams.copy(target, source)
            self.streams.record(self._ready[slot], self.copy_stream)
        self._account(slot, layer, block, source)
        return slot

    def _copy_in_order(self, layer: int, block: int, tokens: int) -> None:
        """The plain schedule: a copy on the compute stream, ordered with everything around it."""
        source = self.store.block(layer, block)[:tokens]
        self.staging_buf[0][:tokens].copy_(source)
        self._account(0, layer, block, source)

    def _account(self, slot: int, layer: int, block: int, source: torch.Tensor) -> None:
        self._holds[slot] = self._key(layer, block, source.shape[0])
        self.stats.h2d_bytes += source.nbytes
        self.stats.blocks_copied += 1

    # ---- writes -------------------------------------------------------------------------
    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Send new tokens' k, v ([B, Hkv, n, D] on the device) to the host store at `start`.
        Buffers holding the blocks it touches become stale."""
        n = k.shape[2]
        first = (start - self.store.first_position) // self.store.block_tokens
        last = (start + n - 1 - self.store.first_position) // self.store.block_tokens
        for b in range(first, last + 1):
            self._versions[(layer, b)] = self._versions.get((layer, b), 0) + 1
        self._writes_pending = True
        if self.overlap:
            self.streams.wait_stream(self.copy_stream, self.streams.current())  # k, v are computed
            with self.streams.on(self.copy_stream):
                self.store.write(layer, start, k, v, copy=self.streams.copy)
                self.streams.record(self._written, self.copy_stream)
            self.streams.keep_alive(k, self.copy_stream)
            self.streams.keep_alive(v, self.copy_stream)
        else:
            self.store.write(layer, start, k, v)
        self.stats.d2h_bytes += k.nbytes + v.nbytes

    def wait_for_writes(self) -> None:
        """The compute stream waits (the host does not) until the last write has read its source,
        so a buffer it sent may be overwritten."""
        if self.overlap:
            self.streams.wait_event(self.streams.current(), self._written)

    def send(self, host: torch.Tensor, source: torch.Tensor) -> None:
        """Copy `source` (on the device) into `host` (pinned, contiguous) behind the work that made
        it, as write does a layer's KV; synchronize waits for it."""
        self._writes_pending = True
        if self.overlap:
            self.streams.wait_stream(self.copy_stream, self.streams.current())
            with self.streams.on(self.copy_stream):
                self.streams.copy(host, source)
            self.streams.keep_alive(source, self.copy_stream)
        else:
            host.copy_(source)
        self.stats.d2h_bytes += source.nbytes

    def synchronize(self) -> None:
        """Wait for every write to the host (before the CPU reads host KV that one may still be
        filling); nothing to wait for when none was issued since the last wait (a retrieval rebuild
        asks once per layer: one wait, not one per layer)."""
        if not self._writes_pending:
            return
        self.streams.synchronize(self.copy_stream)
        self._writes_pending = False
