"""Host logits to a sampled token's distribution: temperature, top-k, top-p and softmax in one
loop per row (triforce.decoding.sampling.probabilities).

Why: torch's ops for one 49152-word row (the division, topk, logsumexp, cumsum, the scatter of
the nucleus, softmax) took ~1.3 ms a sampled token on two Zen 3 cores; most of a nucleus is a
few words. Here one pass keeps the CANDIDATES most likely words in order beside the scaled
logits, one vectorised exp gives every word's weight, and the nucleus is read off the candidates.
A row whose nucleus reaches past them is flagged for the caller's sorting path. Each row's
result depends on that row alone, whatever rows share the call."""
from __future__ import annotations

import numba
import numpy as np
import torch

from triforce.kernels.cpu.simd.exp import exp_in_place
from triforce.kernels.device_kind import on_host

CANDIDATES = 64  # a peaked nucleus is a few words (sampling's torch path keeps as many)
EXP_FLOOR = -87.0  # exp_in_place's clamp: weights below it are taken as zero (exp(-87) ~ 1.6e-38)


def takes(calc: torch.Tensor, top_k: int) -> bool:
    """Whether `distributions` serves these float32 logits ([V] or [R, V] in host memory, wider
    than the candidates) and this top-k (0, off, or one the candidates hold)."""
    return (calc.dtype == torch.float32 and calc.dim() in (1, 2) and on_host(calc)
            and calc.shape[-1] > CANDIDATES and 0 <= top_k <= CANDIDATES)


def distributions(calc: torch.Tensor, temperature: float, top_k: int, top_p: float) -> tuple[torch.Tensor, list[int]]:
    """calc: float32 logits (`takes`) -> (probabilities of calc's shape, the rows whose nucleus
    reaches past the candidates: their values are to be replaced by the caller's). A row with NaN
    or +inf, or with no finite logit, comes out NaN (as softmax gives it)."""
    rows = calc.reshape(-1, calc.shape[-1]).contiguous().numpy()
    out = np.empty(rows.shape, np.float32)
    flagged = _distributions(rows, np.float32(temperature), top_k, top_p, out)
    return torch.from_numpy(out).reshape(calc.shape), np.flatnonzero(flagged).tolist()


@numba.njit(cache=True)
def _distributions(rows, temperature, top_k, top_p, out):
    n, width = rows.shape
    flagged = np.zeros(n, np.uint8)
    values = np.empty(CANDIDATES, np.float32)
    index = np.empty(CANDIDATES, np.int64)
    scaled = np.empty(width, np.float32)
    powers = np.empty(width, np.int32)
    for r in range(n):
        row = out[r]
        if not _scaled(rows[r], temperature, scaled) or _candidates(scaled, values, index) == 0:
            row[:] = np.nan
            continue
        kth = values[top_k - 1] if 0 < top_k < width else -np.inf  # top-k keeps every word tied with the kth
        total, beside = _weights(scaled, values[0], kth, row, powers)
        if top_p < 1.0:
            flagged[r] = _nucleus(row, values, index, kth, beside, total, top_p)
        else:
            scale = 1.0 / total
            for i in range(width):
                row[i] = np.float32(row[i] * scale)
    return flagged


@numba.njit(inline="always")
def _scaled(logits, temperature, scaled):
    """scaled = logits / temperature; False where one is NaN or +inf (a loop that vectorises)."""
    bad = 0
    for i in range(logits.shape[0]):
        s = logits[i] / temperature
        scaled[i] = s
        bad |= not s < np.inf
    return bad == 0


@numba.njit(inline="always")
def _candidates(scaled, values, index):
    """values, index: the CANDIDATES largest of scaled (no NaN), descending, the first index first
    among ties. Returns how many, or 0 where every value is -inf."""
    count = 0
    for i in range(scaled.shape[0]):
        s = scaled[i]
        if count < CANDIDATES:
            count += 1
        elif not s > values[CANDIDATES - 1]:
            continue
        j = count - 1
        while j > 0 and values[j - 1] < s:
            values[j], index[j] = values[j - 1], index[j - 1]
            j -= 1
        values[j], index[j] = s, i
    return count if values[0] > -np.inf else 0


# reassoc: the float64 sum in lanes (one order per build and row; NaN checks stay, unlike fastmath=True)
@numba.njit(fastmath={"reassoc", "contract"}, cache=True)
def _weights(scaled, top, kth, row, powers):
    """row = exp(scaled - top) where the word is at or above kth and its weight above the exp's
    floor, else 0. Returns their float64 sum and how many words have weight."""
    width = row.shape[0]
    for i in range(width):
        row[i] = scaled[i] - top
    exp_in_place(row, width, powers)
    total, beside = 0.0, 0
    for i in range(width):
        kept = scaled[i] >= kth and scaled[i] - top >= EXP_FLOOR
        weight = row[i] if kept else np.float32(0.0)
        row[i] = weight
        total += weight
        beside += kept
    return total, beside


@numba.njit(inline="always")
def _nucleus(row, values, index, kth, beside, total, top_p):
    """row: the weights -> top-p's distribution: each candidate kept whose more likely candidates
    hold less than top_p of the mass (the first always). Returns 1, the row left as it is, when
    every candidate is kept and words with weight lie beyond them."""
    kept, above, count = 0, 0.0, CANDIDATES
    while kept < count and values[kept] >= kth and (kept == 0 or above < top_p * total):
        above += row[index[kept]]
        kept += 1
    if kept == count and beside > count:
        return 1
    weights = np.empty(kept, np.float32)
    for j in range(kept):
        weights[j] = row[index[j]]
    row[:] = 0.0
    for j in range(kept):
        row[index[j]] = np.float32(weights[j] / above)
    return 0


def warm_up() -> None:
    """Compile (or load) the loop for float32 logits, a model's on the CPU."""
    distributions(torch.zeros(1, CANDIDATES + 1, device="cpu"), 0.5, 0, 0.9)
