"""triforce: lossless hierarchical speculative decoding for long-context language models."""
__version__ = "0.1.0"

import os as _os

# Idle kernel threads sleep instead of spinning (read by both OpenMP runtimes, torch's and numba's,
# when they load, so before torch is imported): on a 2-core machine with one other busy program,
# spinning threads left decoding at 0.22-0.31x of its quiet speed, sleeping ones at 0.68-0.80x,
# for 8-14% of quiet speed (bench/contention.py; bench/RESULTS.md). TRIFORCE_THREAD_WAIT=spin keeps
# spinning, for a machine that runs nothing else.
if _os.environ.get("TRIFORCE_THREAD_WAIT", "sleep") != "spin":
    _os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from triforce.numba_cache import use_versioned_cache  # noqa: E402  (before any kernel is compiled)

use_versioned_cache()
