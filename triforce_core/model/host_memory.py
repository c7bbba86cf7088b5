"""Refuse an allocation the host cannot hold, before making it: the kernel's out-of-memory
killer ends a process without a word (and takes a machine's other work with it)."""
from __future__ import annotations

import torch

from triforce.errors import UserError


def available_bytes() -> int:
    import psutil

    return int(psutil.virtual_memory().available)


def check_host_room(needed: int, what: str, fix: str) -> None:
    """`needed` more bytes of host memory for `what`; `fix` says what to change."""
    available = available_bytes()
    if needed > available:
        raise UserError(f"{what} needs {needed / 2**30:.2f} GiB of host memory but {available / 2**30:.2f} GiB "
                        f"is available: {fix}")


def meta_model_bytes(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """What materialising a meta-device model in `dtype` takes (shared tensors counted once)."""
    seen, total = set(), 0
    for tensor in list(model.parameters()) + list(model.buffers()):
        if id(tensor) not in seen:
            seen.add(id(tensor))
            total += tensor.numel() * (dtype.itemsize if tensor.is_floating_point() else tensor.element_size())
    return total
