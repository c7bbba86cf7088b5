"""Prefetch hints (triforce.kernels.cpu.simd.prefetch) never fault and never change what a kernel reads."""
import numba
import numpy as np

from triforce.kernels.cpu.simd.prefetch import ask_rows


@numba.njit
def _sum_asking(a, ahead):
    total = 0.0
    for r in range(a.shape[0]):
        ask_rows(a, r + ahead, 4)  # past the end on the last rows, far past it for large `ahead`
        total += a[r].sum()
    return total


def test_rows_past_the_end_are_asked_for_harmlessly():
    a = np.arange(64 * 37, dtype=np.float32).reshape(37, 64)
    for ahead in (0, 1, 64, 1 << 20):
        assert _sum_asking(a, ahead) == a.astype(np.float64).sum()
    assert _sum_asking(a[5:9], 3) == a[5:9].astype(np.float64).sum()  # a view inside a larger buffer
