"""One token drawn from a host probability vector by its cumulative sums (triforce.decoding.sampling).

Why: torch's CPU multinomial draws one exponential per word for a single sample: ~1.6 ms a token
over a 49152-word vocabulary on two Zen 3 cores, where this loop takes ~0.1 ms (bench/RESULTS.md,
"Straight into the cache"). Same distribution: word i is drawn when u * total falls in
[c_{i-1}, c_i) of the float64 running sums, so a word of probability zero never is."""
from __future__ import annotations

import numba
import numpy as np

NOT_FINITE, NEGATIVE, NO_MASS = -1, -2, -3  # what `draw` returns for probabilities it cannot draw from


@numba.njit(cache=True)
def draw(probs, u):
    """The word of probs [V] (float32 or float64, unnormalised) at uniform u in [0, 1), or one of
    NOT_FINITE, NEGATIVE, NO_MASS (checked in that order over the whole vector)."""
    total = 0.0
    negative = False
    for i in range(probs.shape[0]):
        p = np.float64(probs[i])
        if not np.isfinite(p):
            return NOT_FINITE
        negative |= p < 0
        total += p
    if negative:
        return NEGATIVE
    if total <= 0:
        return NO_MASS
    target = u * total
    running, last = 0.0, 0
    for i in range(probs.shape[0]):
        p = np.float64(probs[i])
        if p > 0:
            running += p
            last = i
            if running > target:
                return i
    return last  # u * total rounded up to the total: the last word with mass


def warm_up() -> None:
    """Compile (or load) the loop for float32 probabilities, a model's on the CPU."""
    draw(np.ones(2, np.float32), 0.5)
