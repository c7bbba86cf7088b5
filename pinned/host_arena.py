"""One host buffer that the KV stores of a benchmark's methods borrow in turn.

At 127K tokens a 7B model's host KV is 62 GiB; allocating, pinning and filling it once per method
costs more than timing the method. Each store built from the arena is a view of its leading bytes
(the layouts differ between plans; the bytes are only timed, never read as a model's KV), and the
random fill is done once, up to the largest store asked for."""
from __future__ import annotations

import torch

from triforce.pinned.host_memory import HostCapacityError, allocate_host

FILL_CHUNK_BYTES = 64 << 20  # one random chunk copied over the buffer: memcpy speed, not randn speed


class HostArena:
    def __init__(self, nbytes: int, *, pin: bool = True, budget_bytes: int | None = None):
        (self.data,) = allocate_host([(int(nbytes),)], torch.uint8, pin=pin, budget_bytes=budget_bytes,
                                     what="the shared host KV store")
        self.filled = 0  # leading bytes that hold random values already

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def view(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A tensor of `shape` over the arena's leading bytes (not zeroed: a store borrowing it
        holds whatever the last one wrote)."""
        need = dtype.itemsize
        for n in shape:
            need *= n
        if need > self.nbytes:
            raise HostCapacityError(f"a host KV store of {need} bytes does not fit the shared one of {self.nbytes}")
        return self.data[:need].view(dtype).view(shape)

    def fill_random(self, nbytes: int, dtype: torch.dtype, seed: int = 0) -> None:
        """Random values of `dtype` in the first `nbytes` (only the part not filled yet)."""
        nbytes = min(int(nbytes), self.nbytes)
        if nbytes <= self.filled:
            return
        g = torch.Generator(device="cpu").manual_seed(seed)
        at = self.filled - self.filled % dtype.itemsize  # whole values from here on
        size = min(FILL_CHUNK_BYTES, nbytes - at) // dtype.itemsize + 1
        chunk = torch.randn(size, generator=g, device="cpu").to(dtype).view(torch.uint8)
        while at < nbytes:
            n = min(chunk.numel(), nbytes - at)
            self.data[at:at + n].copy_(chunk[:n])
            at += n
        self.filled = nbytes
