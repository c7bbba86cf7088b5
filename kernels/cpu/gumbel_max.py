"""A seeded request's choice per row of host probabilities, by the Gumbel-max trick, and whether
any probability is not finite, in one pass (triforce.decoding.sampling.PositionNoise).

Why: drawing the noise with torch (a generator seeded per position, 49152 float64 uniforms, two
logarithms of each) and adding it to the rows' logarithms cost more than any other part of a
seeded token on two Zen 3 cores (bench/RESULTS.md, "Sampling in loops"), where a nucleus holds
a few words. Here a word's uniform is SplitMix64's output number j + 1 from the position's key
(random access: only words with probability are drawn for) and only their logarithms are taken;
a card draws the same numbers for every word (sampling._uniforms)."""
from __future__ import annotations

import numba
import numpy as np
import torch

from triforce.kernels.device_kind import on_host

GOLDEN = np.uint64(0x9E3779B97F4A7C15)  # SplitMix64's increment


def takes(probs: torch.Tensor) -> bool:
    """Whether `choices` serves these probabilities: [n, V] float32 or float64 in host memory."""
    return probs.dim() == 2 and probs.dtype in (torch.float32, torch.float64) and on_host(probs)


def choices(probs: torch.Tensor, keys: list[int]) -> list[int]:
    """Row i's choice: the word j of largest log p_ij + g_ij, g_ij Gumbel noise from keys[i]
    (a 64-bit key per row) and j alone, the first among ties; then 1 if any probability is inf
    or NaN, else 0."""
    return _choices(probs.contiguous().numpy(), np.array(keys, np.uint64)).tolist()


@numba.njit(cache=True)
def _mix(x):
    """SplitMix64's finaliser (as sampling._mix64 after its increment): 64 well-mixed bits."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


@numba.njit(cache=True)
def uniform(key, j):
    """Word j's uniform in (0, 1) under `key`: 53 bits of SplitMix64's output j + 1, never 0 or 1."""
    return (np.float64(_mix(key + np.uint64(j + 1) * GOLDEN) >> np.uint64(11)) + 0.5) * 2.0 ** -53


@numba.njit(cache=True)
def _choices(probs, keys):
    n, width = probs.shape
    out = np.zeros(n + 1, np.int64)
    for i in range(n):
        best, top = 0, -np.inf
        for j in range(width):
            p = probs[i, j]
            if not np.isfinite(p):
                out[n] = 1
            elif p > 0:
                score = np.log(np.float64(p)) - np.log(-np.log(uniform(keys[i], j)))
                if score > top:
                    best, top = j, score
        out[i] = best
    return out


def warm_up() -> None:
    """Compile (or load) the loop for float32 probabilities, a model's on the CPU."""
    choices(torch.ones(1, 2, device="cpu"), [1])
