"""exp over float32 arrays in numba, in loops that vectorise.

Why: numba's np.exp is a scalar libm call per element (no SVML in this build), a quarter of a
decoding step's attention and most of an MLP's SiLU on the CPU. This is Cephes' expf (Cody-Waite
range reduction, a degree-6 polynomial, within 2 ulp of exp for |x| < 87), with 2^n built from
its exponent bits in a second loop so that both loops vectorise."""
from __future__ import annotations

import numba
import numpy as np


@numba.njit(cache=True)
def exp_in_place(a, n, powers):
    """a[:n] = exp(a[:n]) (float32); powers: int32 scratch of at least n. Inputs are clamped to
    [-87, 88] (exp(-87) ~ 1.6e-38, the normal floor). Not fastmath: the reduction
    x - n*C1 - n*C2 must not be reassociated."""
    scales = powers.view(np.float32)
    for s in range(n):
        x = min(max(a[s], np.float32(-87.0)), np.float32(88.0))
        k = np.floor(x * np.float32(1.44269504) + np.float32(0.5))
        f = x - k * np.float32(0.693359375) - k * np.float32(-2.12194440e-4)
        p = np.float32(1.9875691500e-4)
        p = p * f + np.float32(1.3981999507e-3)
        p = p * f + np.float32(8.3334519073e-3)
        p = p * f + np.float32(4.1665795894e-2)
        p = p * f + np.float32(1.6666665459e-1)
        p = p * f + np.float32(5.0000001201e-1)
        a[s] = p * f * f + f + np.float32(1.0)
        powers[s] = (np.int32(k) + np.int32(127)) << 23
    for s in range(n):
        a[s] *= scales[s]
