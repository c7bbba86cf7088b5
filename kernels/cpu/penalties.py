"""Repeat, frequency and presence penalties on host logits, one loop over each row's window
(triforce.decoding.sampling.penalize).

Why: torch's way (a zeroed count row the vocabulary wide, a scatter, then two `where`s and three
arithmetic passes over every word) touches ~10 vocabulary-wide rows where a window changes at
most penalty_last_n words (bench/RESULTS.md, "Sampling in loops"). The same arithmetic as
torch's, in the rows' dtype, on the words the window holds; every other word is copied."""
from __future__ import annotations

import numba
import numpy as np
import torch

from triforce.kernels.device_kind import on_host


def takes(calc: torch.Tensor) -> bool:
    """Whether `penalized` serves these logits: [R, V] float32 or float64 in host memory."""
    return calc.dim() == 2 and calc.dtype in (torch.float32, torch.float64) and on_host(calc)


def penalized(calc: torch.Tensor, windows: list[list[int]], repeat: float, frequency: float,
              presence: float) -> torch.Tensor:
    """calc [R, V] (`takes`); windows[r]: the token ids row r is penalised for (repeats count) ->
    a new [R, V] tensor: a word in its row's window divided (positive) or multiplied (negative)
    by `repeat`, less frequency times its count, less presence."""
    rows = calc.contiguous().numpy()
    width = max(len(w) for w in windows)
    ids = np.full((len(windows), width), -1, np.int64)  # -1: no token (a shorter window)
    for r, window in enumerate(windows):
        ids[r, :len(window)] = window
    out = np.empty(rows.shape, rows.dtype)
    as_rows = rows.dtype.type  # the scalars in the rows' dtype, as torch's operators take them
    _penalized(rows, ids, as_rows(repeat), as_rows(frequency), as_rows(presence), out)
    return torch.from_numpy(out)


@numba.njit(cache=True)
def _penalized(rows, ids, repeat, frequency, presence, out):
    n, vocab = rows.shape
    counts = np.zeros(vocab, rows.dtype)  # in the rows' dtype: count * frequency rounds as torch's does
    for r in range(n):
        out[r] = rows[r]
        for token in ids[r]:
            if 0 <= token < vocab:
                counts[token] += 1
        for token in ids[r]:
            if 0 <= token < vocab and counts[token] > 0:
                value = out[r, token]
                if repeat != 1:
                    value = value / repeat if value > 0 else value * repeat
                out[r, token] = value - counts[token] * frequency - presence
                counts[token] = 0  # each word once, whatever its count


def warm_up() -> None:
    """Compile (or load) the loop for float32 logits, a model's on the CPU."""
    penalized(torch.zeros(1, 4, device="cpu"), [[1, 1, 2]], 1.1, 0.0, 0.0)
