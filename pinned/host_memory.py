"""Host memory for offloaded KV: pinned when CUDA is there (so copies can run asynchronously),
pageable otherwise; capacity checked before anything is allocated."""
from __future__ import annotations

import psutil
import torch

# Host memory left for everything else (the OS, Python, the model's own host copies).
HOST_SAFETY_BYTES = 1 << 30


class HostCapacityError(MemoryError):
    """The host cannot hold what was asked for; the message says how much is missing."""


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def host_available_bytes() -> int:
    return int(psutil.virtual_memory().available)


def can_pin() -> bool:
    return torch.cuda.is_available()


def allocate_host(shapes: list[tuple[int, ...]], dtype: torch.dtype, *, pin: bool = True,
                  budget_bytes: int | None = None, what: str = "host buffers") -> list[torch.Tensor]:
    """Zero-filled host tensors of `shapes`, all or nothing.

    Raises HostCapacityError (and allocates nothing) when the total exceeds `budget_bytes` or what
    the host has available minus a safety margin."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    total = sum(itemsize * _numel(s) for s in shapes)
    if budget_bytes is not None and total > budget_bytes:
        raise HostCapacityError(f"{what} need {_gib(total)} of host memory but the profile allows "
                                f"{_gib(budget_bytes)} (raise host_bytes, shorten the context, or keep "
                                "more KV on the GPU)")
    available = host_available_bytes() - HOST_SAFETY_BYTES
    if total > available:
        raise HostCapacityError(f"{what} need {_gib(total)} of host memory but only "
                                f"{_gib(max(available, 0))} is available (shorten the context or "
                                "free memory)")
    pin = pin and can_pin()
    made: list[torch.Tensor] = []
    try:
        for shape in shapes:
            try:
                made.append(torch.zeros(shape, dtype=dtype, pin_memory=pin))
            except RuntimeError:
                if not pin:
                    raise
                pin = False  # the driver refused to pin this much: fall back to pageable memory
                made.append(torch.zeros(shape, dtype=dtype))
    except (RuntimeError, MemoryError) as e:
        made.clear()
        raise HostCapacityError(f"allocating {_gib(total)} of {what} failed: {e}") from None
    return made


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
