"""How idle kernel threads wait, decided before torch and numba load their OpenMP runtimes (they
read OMP_WAIT_POLICY once, when they load).

Waking sleeping threads for each of a token's parallel kernels costs about half the decoding speed
on a machine that runs nothing else; spinning ones take the cores another busy program needs
(bench/RESULTS.md, idle threads; bench/history/2026-11-27-suite-workers-and-thread-waits.md). So TRIFORCE_THREAD_WAIT=auto (the default) lets them spin
(libgomp's own spin-then-sleep) only where the cores this process may use were idle when it
started, and sleep otherwise; `sleep` and `spin` decide alone; an OMP_WAIT_POLICY already set wins."""
from __future__ import annotations

import os

QUIET_CORES = 0.25   # other programs' use of our cores (in cores) below which they count as idle
SAMPLE_S = 0.1       # how long the cores are watched (once, at import)


def cores_used_by_others(seconds: float = SAMPLE_S) -> float:
    """Cores' worth of CPU time the cores this process may use spent busy over `seconds`, while
    this process sleeps (so all of it is other programs'), leaving out programs at a lower priority
    (nice > 0: the kernel gives their time to ours, so spinning costs them, not us; counting them
    cost 38% beside a nice 19 busy loop, issue 76). Read from the cores' own counters:
    psutil 7.2's cpu_times_percent takes a window under a second for a whole one (0.1 s read as
    90% busy on a quiet machine), and threads then slept where spinning ran 1.26x faster."""
    import time

    import psutil

    before = psutil.cpu_times(percpu=True)
    time.sleep(seconds)
    after = psutil.cpu_times(percpu=True)
    try:
        mine = os.sched_getaffinity(0)
    except AttributeError:  # not on Linux
        mine = range(len(after))
    read = min(len(before), len(after))  # cores both readings list
    return sum(_busy_at_our_priority(before[i], after[i]) for i in mine if i < read)


def _busy_at_our_priority(before, after) -> float:
    """The share of a core's time between two readings of its counters spent busy, less what
    niced programs and waits for disks took (guest time is inside user and nice already)."""
    delta = {field: getattr(after, field) - getattr(before, field) for field in after._fields}
    total = sum(delta.values()) - delta.get("guest", 0.0) - delta.get("guest_nice", 0.0)
    if total <= 0:
        return 0.0
    idle = delta["idle"] + delta.get("iowait", 0.0) + delta.get("nice", 0.0)
    return max(0.0, total - idle) / total


def decide(environ, others=cores_used_by_others) -> str:
    """Set OMP_WAIT_POLICY in `environ` as TRIFORCE_THREAD_WAIT says; returns 'sleep' or 'spin'."""
    if "OMP_WAIT_POLICY" in environ:
        return "spin" if environ["OMP_WAIT_POLICY"].upper() == "ACTIVE" else "sleep"
    wait = environ.get("TRIFORCE_THREAD_WAIT", "auto")
    if wait == "auto":
        wait = "spin" if others() < QUIET_CORES else "sleep"
    if wait != "spin":
        environ["OMP_WAIT_POLICY"] = "PASSIVE"
        return "sleep"
    return "spin"
