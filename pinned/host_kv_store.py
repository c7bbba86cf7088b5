"""The host KV store: keys and values of the offloaded token range of every layer.

Layout: data [num_layers, num_blocks, block_tokens, 2 (K, V), B, Hkv, D]. Blocks are the unit
of transfer: one block of one layer is one contiguous copy over PCIe. Inside a block tokens come
first, so the new tokens of a pass, written at consecutive positions, are one contiguous host
range too: each block a write touches is one copy from a packed device buffer (`pack`), never a
strided copy that PyTorch would stage through pageable memory. Slot i of the store holds the token at position
`first_position + i`. The store only holds data; the prefetcher decides when copies run and on
which stream."""
from __future__ import annotations

import torch

from triforce.pinned.cpu_kernels import gather_blocked
from triforce.pinned.host_memory import allocate_host, is_registered


class HostKVStore:
    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, capacity: int, block_tokens: int, *,
                 first_position: int, dtype: torch.dtype, batch: int = 1, pin: bool = True,
                 budget_bytes: int | None = None, arena=None):
        """arena: a HostArena whose bytes the store borrows (a benchmark's methods in turn)
        instead of allocating its own."""
        if block_tokens < 1:
            raise ValueError("block_tokens must be >= 1")
        self.num_blocks = max(1, -(-capacity // block_tokens))
        shape = (num_layers, self.num_blocks, block_tokens, 2, batch, kv_heads, head_dim)
        if arena is not None:
            self.data = arena.view(shape, dtype)
        else:
            (self.data,) = allocate_host([shape], dtype, pin=pin, budget_bytes=budget_bytes,
                                         what="the host KV store")
        self.block_tokens = block_tokens
        self.capacity = self.num_blocks * block_tokens
        self.first_position = first_position

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    @staticmethod
    def bytes_for(num_layers: int, kv_heads: int, head_dim: int, capacity: int, block_tokens: int,
                  dtype: torch.dtype, batch: int = 1) -> int:
        """What a store of these sizes allocates (its capacity rounded up to whole blocks)."""
        blocks = max(1, -(-capacity // block_tokens))
        return num_layers * blocks * block_tokens * 2 * batch * kv_heads * head_dim * dtype.itemsize

    @property
    def pinned(self) -> bool:
        return is_registered(self.data) or self.data.is_pinned()

    def block(self, layer: int, index: int) -> torch.Tensor:
        """Block `index` of `layer`: [block_tokens, 2, B, Hkv, D], contiguous (one copy)."""
        return self.data[layer, index]

    @staticmethod
    def block_kv(block: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views k, v [B, Hkv, count, D] of the first `count` tokens of a block (or of a staging
        buffer holding one)."""
        return block[:count, 0].permute(1, 2, 0, 3), block[:count, 1].permute(1, 2, 0, 3)

    def block_start(self, index: int) -> int:
        """Position of the first token of block `index`."""
        return self.first_position + index * self.block_tokens

    def _pieces(self, start: int, end: int):
        """(block, first slot, last slot, offset into [start, end)) for each block the range touches."""
        lo, hi = start - self.first_position, end - self.first_position
        if lo < 0 or hi > self.capacity or lo > hi:
            raise IndexError(f"positions {start}..{end} are outside the host store "
                             f"({self.first_position}..{self.first_position + self.capacity})")
        at = lo
        while at < hi:
            b, o = divmod(at, self.block_tokens)
            n = min(self.block_tokens - o, hi - at)
            yield b, o, o + n, at - lo
            at += n

    @staticmethod
    def pack(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """k, v [B, Hkv, n, D] -> one contiguous [n, 2, B, Hkv, D] buffer on their device (one copy)."""
        return torch.stack((k.permute(2, 0, 1, 3), v.permute(2, 0, 1, 3)), dim=1)

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor, copy=None) -> None:
        """Store k, v ([B, Hkv, n, D], any device) at positions [start, start + n) of `layer`:
        each block touched packed on k's device, then one contiguous copy. A block at a time keeps
        the device's extra memory to one block's KV (a whole layer's, packed at once, ran a 24 GB
        card out of memory at 32K: bench/history/2026-11-28-gpu-campaign-h200.md). `copy(dst, src)`
        runs each copy (the prefetcher's, on its copy stream, where each packed block is freed
        for the next in stream order); a plain copy_ when None."""
        copy = copy or torch.Tensor.copy_
        for b, s0, s1, at in self._pieces(start, start + k.shape[2]):  # each packed block freed before the next
            copy(self.data[layer, b, s0:s1], self.pack(k[:, :, at:at + s1 - s0], v[:, :, at:at + s1 - s0]))

    def read(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies [L, B, Hkv, end - start, D] of positions [start, end) in every layer."""
        tokens = torch.cat([self.data[:, b, s0:s1] for b, s0, s1, _ in self._pieces(start, end)], dim=1)
        return tokens[:, :, 0].permute(0, 2, 3, 1, 4).contiguous(), tokens[:, :, 1].permute(0, 2, 3, 1, 4).contiguous()

    def keys_of_block(self, layer: int, index: int) -> torch.Tensor:
        """[B, Hkv, block_tokens, D] view."""
        return self.data[layer, index, :, 0].permute(1, 2, 0, 3)

    def gather(self, layer: int, index: torch.Tensor, out_k: torch.Tensor, out_v: torch.Tensor) -> None:
        """out[b, h, n] = entry at position index[b, h, n] for positions inside the store; other
        entries of out are left as they are. index: [B, Hkv, N] int64 on the CPU; out_*: host
        tensors [B, Hkv, N, D] of the store's dtype. Runs the parallel numba kernel."""
        gather_blocked(self.data[layer], index, self.first_position, out_k, out_v)
