"""How the linear kernels share a weight matrix's rows among threads: jobs of ROW_BLOCK rows each,
long enough to amortise a job's start. One split for every linear kernel (float32 FMA, bfloat16
pairs, widening, blocks), so they divide work alike."""
from __future__ import annotations

import numba

ROW_BLOCK = 16


@numba.njit(inline="always")
def row_jobs(n):
    """How many jobs n rows make."""
    return (n + ROW_BLOCK - 1) // ROW_BLOCK


@numba.njit(inline="always")
def job_span(job, n):
    """The rows [start, stop) of job `job`."""
    return job * ROW_BLOCK, min(n, (job + 1) * ROW_BLOCK)
