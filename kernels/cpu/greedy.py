"""The target's greedy choice per row of host logits, and whether any logit is not finite, in one
pass (triforce.decoding.verification).

Why: torch's argmax and its isfinite, invert and any over a 49152-word vocabulary took ~250 us a
token on two Zen 3 cores and woke torch's thread pool beside numba's; this loop takes ~45 us on one
(bench/RESULTS.md, "Straight into the cache")."""
from __future__ import annotations

import numba
import numpy as np
import torch

from triforce.kernels.device_kind import on_host


def takes(rows: torch.Tensor) -> bool:
    """Whether `choices` serves these logits: [n, V] float32 or float64 in host memory."""
    return rows.dim() == 2 and rows.dtype in (torch.float32, torch.float64) and on_host(rows)


def choices(rows: torch.Tensor) -> list[int]:
    """Each row's first index of its largest value (torch.argmax's choice on finite rows), then 1
    if any value of any row is inf or NaN, else 0."""
    return _first_max_and_bad(rows.contiguous().numpy()).tolist()


@numba.njit(cache=True)
def _first_max_and_bad(rows):
    n, width = rows.shape
    out = np.zeros(n + 1, np.int64)
    for i in range(n):
        best, top = 0, rows[i, 0]
        for j in range(width):
            value = rows[i, j]
            if not np.isfinite(value):
                out[n] = 1
            elif value > top:
                best, top = j, value
        out[i] = best
    return out


def warm_up() -> None:
    """Compile (or load) the loop for float32 logits, a model's on the CPU."""
    choices(torch.zeros(1, 2, device="cpu"))
