"""The prefetcher: every stream, event and staging buffer of the offloaded KV lives here.

Host KV blocks reach the device through staging buffers on one copy stream. In the overlapped
schedule there are two buffers: while attention runs over block i, block i + 1 (the next block of
the layer, or the first of the next layer) is already being copied, and before a verify pass the
first blocks are copied while the drafting tiers run. The plain schedule has one buffer and
copies each block just before it is used. New tokens' KV goes back to the host on the same copy
stream, so a later read of the same block can never overtake the write.

On a CPU device there are no streams: the same schedule runs with synchronous copies.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from triforce.pinned import HostKVStore


@dataclass
class TransferStats:
    h2d_bytes: int = 0
    d2h_bytes: int = 0
    blocks_copied: int = 0
    hits: int = 0      # reads served by a block copied ahead of time
    misses: int = 0    # reads that had to start their copy on demand


class Prefetcher:
    """schedule(layer) -> the host block indices a verify pass reads in that layer, in order."""

    def __init__(self, store: HostKVStore, device: torch.device, *, overlap: bool = True):
        self.store = store
        self.device = torch.device(device)
        self.overlap = overlap
        num_buffers = 2 if overlap else 1
        shape = store.block(0, 0).shape
        self.staging_buf = [torch.empty(shape, dtype=store.data.dtype, device=self.device)
                            for _ in range(num_buffers)]
        self.cuda = self.device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._ready = [self._event() for _ in range(num_buffers)]   # copy into buffer done
        self._free = [self._event() for _ in range(num_buffers)]    # compute done reading buffer
        self._holds: list[tuple | None] = [None] * num_buffers     # (layer, block, version)
        self._versions: dict[tuple[int, int], int] = {}
        self.schedule: Callable[[int], list[int]] = lambda layer: []
        self.num_layers = store.data.shape[0]
        self.stats = TransferStats()

    @property
    def staging_bytes(self) -> int:
        return sum(b.nbytes for b in self.staging_buf)

    def _event(self):
        return torch.cuda.Event() if self.cuda else None

    def _key(self, layer: int, block: int) -> tuple:
        return layer, block, self._versions.get((layer, block), 0)

    # ---- reads --------------------------------------------------------------------------
    def read(self, layer: int) -> Iterator[tuple[int, torch.Tensor]]:
        """Yield (block index, staging view [2, B, Hkv, block_tokens, D]) for each scheduled block
        of `layer`. A view is valid until the next item is requested."""
        blocks = self.schedule(layer)
        for i, block in enumerate(blocks):
            if not self.overlap:
                self._copy(0, layer, block, wait_free=False)
                self.stats.misses += 1
                yield block, self.staging_buf[0]
                continue
            slot = self._held(layer, block)
            upcoming = self._next_read(layer, blocks, i)
            if slot is None:
                protect = self._held(*upcoming) if upcoming is not None else None
                slot = self._issue(layer, block, avoid=protect)
                self.stats.misses += 1
            else:
                self.stats.hits += 1
            if upcoming is not None and self._held(*upcoming) is None:
                self._issue(*upcoming, avoid=slot)
            if self.cuda:
                torch.cuda.current_stream(self.device).wait_event(self._ready[slot])
            yield block, self.staging_buf[slot]
            if self.cuda:
                self._free[slot].record(torch.cuda.current_stream(self.device))

    def prefetch(self) -> None:
        """Start copying the first two blocks of the coming pass (called before drafting)."""
        if not self.overlap:
            return
        first = self._next_read(-1, [], 0)
        if first is None:
            return
        second = self._next_read(first[0], self.schedule(first[0]), 0)
        slot = self._held(*first)
        if slot is None:
            slot = self._issue(*first, avoid=self._held(*second) if second is not None else None)
        if second is not None and self._held(*second) is None:
            self._issue(*second, avoid=slot)

    def _next_read(self, layer: int, blocks: list[int], i: int) -> tuple[int, int] | None:
        if layer >= 0 and i + 1 < len(blocks):
            return layer, blocks[i + 1]
        for later in range(layer + 1, self.num_layers):
            following = self.schedule(later)
            if following:
                return later, following[0]
        return None

    def _held(self, layer: int, block: int) -> int | None:
        key = self._key(layer, block)
        for slot, held in enumerate(self._holds):
            if held == key:
                return slot
        return None

    def _issue(self, layer: int, block: int, avoid: int | None) -> int:
        slot = next(s for s in range(len(self.staging_buf)) if s != avoid)
        self._copy(slot, layer, block, wait_free=True)
        return slot

    def _copy(self, slot: int, layer: int, block: int, wait_free: bool) -> None:
        source = self.store.block(layer, block)
        target = self.staging_buf[slot]
        if self.cuda and self.overlap:
            if wait_free:
                self.copy_stream.wait_event(self._free[slot])
            with torch.cuda.stream(self.copy_stream):
                target.copy_(source, non_blocking=True)
                self._ready[slot].record(self.copy_stream)
        else:
            target.copy_(source)
        self._holds[slot] = self._key(layer, block)
        self.stats.h2d_bytes += source.nbytes
        self.stats.blocks_copied += 1

    # ---- writes -------------------------------------------------------------------------
    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Send new tokens' k, v ([B, Hkv, n, D] on the device) to the host store at `start`.
        Buffers holding the blocks it touches become stale."""
        n = k.shape[2]
        for b in range((start - self.store.first_position) // self.store.block_tokens,
                       (start + n - 1 - self.store.first_position) // self.store.block_tokens + 1):
            self._versions[(layer, b)] = self._versions.get((layer, b), 0) + 1
        if self.cuda and self.overlap:
            self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.copy_stream):
                self.store.write(layer, start, k, v, non_blocking=True)
            k.record_stream(self.copy_stream)
            v.record_stream(self.copy_stream)
        else:
            self.store.write(layer, start, k, v)
        self.stats.d2h_bytes += k.nbytes + v.nbytes

    def synchronize(self) -> None:
        """Wait for every copy (before the CPU reads host KV that a write may still be filling)."""
        if self.copy_stream is not None:
            self.copy_stream.synchronize()
