"""How many CPU threads the kernels use (`--threads N`, as llama.cpp's -t), for torch's pool and
numba's alike.

The default is the cores this process may run on (its CPU affinity), never more: two pools of
that many threads each are what the kernels' parallel loops were tuned for. See
triforce.cli.main for how their idle threads wait (they must not spin on a shared machine)."""
from __future__ import annotations

import os

from triforce.errors import UserError


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def use_threads(threads: int | None) -> int:
    """Set both pools to `threads` (None: the available cores) and return the count in use."""
    import numba
    import torch

    cores = available_cores()
    count = cores if threads is None else threads
    if not 1 <= count <= max(cores, numba.config.NUMBA_NUM_THREADS):
        raise UserError(f"--threads must be from 1 to {max(cores, numba.config.NUMBA_NUM_THREADS)} "
                        f"(the cores this process may use), got {count}")
    torch.set_num_threads(count)
    numba.set_num_threads(min(count, numba.config.NUMBA_NUM_THREADS))
    return count


def threads_in_use() -> int:
    import torch
    return torch.get_num_threads()
