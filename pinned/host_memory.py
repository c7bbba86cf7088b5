"""Host memory for offloaded KV: pinned when CUDA is there (so copies can run asynchronously),
pageable otherwise; capacity checked before anything is allocated.

Pinning is exact: PyTorch's caching host allocator (`pin_memory=True`) rounds every block up to a
power of two (a 40 GB store would lock 64 GB), so a buffer is allocated pageable at its exact size
and then page-locked with cudaHostRegister. Every pinned byte is counted here (`pinned_bytes`), the
check is made against physical RAM (locked pages cannot be swapped), and a failed pin is said on
stderr: the run goes on with pageable memory, where every `non_blocking` copy serialises."""
from __future__ import annotations

import sys
import weakref

import psutil
import torch

# Host memory left for everything else (the OS, Python, the model's own host copies).
HOST_SAFETY_BYTES = 1 << 30

_pinned: dict[int, int] = {}  # data_ptr -> bytes page-locked by this process through register_pinned


class HostCapacityError(MemoryError):
    """The host cannot hold what was asked for; the message says how much is missing."""


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def host_available_bytes() -> int:
    return int(psutil.virtual_memory().available)


def host_total_bytes() -> int:
    return int(psutil.virtual_memory().total)


def can_pin() -> bool:
    return torch.cuda.is_available()


def pinned_bytes() -> int:
    """Bytes this process has page-locked through allocate_host and still holds."""
    return sum(_pinned.values())


def is_registered(t: torch.Tensor) -> bool:
    """Whether t's storage was page-locked by register_pinned (also under a stand-in cudart)."""
    return t.untyped_storage().data_ptr() in _pinned


def register_pinned(t: torch.Tensor, cudart=None) -> None:
    """Page-lock exactly t's bytes (cudaHostRegister); unregistered when its memory is freed (the
    storage's end, not t's: a detached view may outlive t). Raises
    RuntimeError when the driver refuses. `cudart` replaces torch.cuda.cudart() in tests."""
    cudart = cudart or torch.cuda.cudart()
    ptr, size = t.data_ptr(), t.untyped_storage().nbytes()
    err = cudart.cudaHostRegister(ptr, size, 0)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister of {_gib(size)} failed with CUDA error {int(err)}")
    _pinned[ptr] = size

    def release(ptr=ptr):
        _pinned.pop(ptr, None)
        try:
            cudart.cudaHostUnregister(ptr)
        except Exception:  # interpreter shutdown: the process is leaving anyway
            pass

    weakref.finalize(t.untyped_storage(), release)  # torch keeps one Python object per storage


def allocate_host(shapes: list[tuple[int, ...]], dtype: torch.dtype, *, pin: bool = True,
                  budget_bytes: int | None = None, what: str = "host buffers", cudart=None,
                  pin_available: bool | None = None) -> list[torch.Tensor]:
    """Zero-filled host tensors of `shapes`, all or nothing, pinned at their exact size when `pin`
    and CUDA is there (`pin_available` overrides that test, with a stand-in `cudart`, for tests).

    Raises HostCapacityError (and allocates nothing) when the total exceeds `budget_bytes`, what
    the host has available minus a safety margin, or (pinned) physical RAM less what is pinned."""
    itemsize = dtype.itemsize
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
    pin = pin and (can_pin() if pin_available is None else pin_available)
    if pin:
        lockable = host_total_bytes() - HOST_SAFETY_BYTES - pinned_bytes()
        if total > lockable:
            raise HostCapacityError(f"{what} need {_gib(total)} of page-locked memory but only "
                                    f"{_gib(max(lockable, 0))} of RAM can still be locked (shorten the "
                                    "context or keep more KV on the GPU)")
    made: list[torch.Tensor] = []
    try:
        for shape in shapes:
            made.append(torch.zeros(shape, dtype=dtype, device="cpu"))
    except (RuntimeError, MemoryError) as e:
        made.clear()
        raise HostCapacityError(f"allocating {_gib(total)} of {what} failed: {e}") from None
    if pin:
        try:
            for t in made:
                register_pinned(t, cudart)
        except RuntimeError as e:
            print(f"triforce: warning: could not pin {_gib(total)} of {what} ({str(e).splitlines()[0]}); "
                  "using pageable memory, so host-to-device copies will not overlap with compute",
                  file=sys.stderr)
    return made


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
