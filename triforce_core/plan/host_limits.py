"""How much host memory a plan may give the KV store on the machine that runs: what the kernel
says is available, bounded by the container's cgroup (v2 or v1; psutil reads the host's RAM, not
the container's limit), less a margin that grows with the machine. `--host-memory` plans for
another machine instead: that much RAM, less the same margin.

A named GPU profile describes its card only: a desktop with that card may have 32 GB of RAM or
256, so the host side is read here, never assumed."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from triforce.plan.profiles import format_size, load_profile, parse_size

GIB = 1 << 30
MARGIN_SHARE = 0.10  # of the machine's memory kept for the system, the weights' page cache and other programs
MARGIN_MIN = 2 * GIB
UNLIMITED = 1 << 60  # a cgroup v1 "no limit" reads as ~2^63


@dataclass(frozen=True)
class HostMemory:
    total: int                 # the machine's (or the container's) memory
    available: int             # free for a new allocation now
    source: str                # where the figures come from, for people

    @property
    def margin(self) -> int:
        return max(MARGIN_MIN, int(MARGIN_SHARE * self.total))

    @property
    def usable(self) -> int:
        """What the KV store and its staging may take."""
        return max(0, min(self.available, self.total) - self.margin)

    def describe(self) -> str:
        return (f"{format_size(self.usable)} usable of {format_size(self.available)} available "
                f"({self.source}; {format_size(self.margin)} kept free)")


def read_host_memory(root: Path = Path("/")) -> HostMemory:
    """This machine's memory, with the tightest cgroup limit on this process (root: a test's /)."""
    import psutil

    vm = psutil.virtual_memory()
    total, available, source = int(vm.total), int(vm.available), "this machine"
    limited = _cgroup(root)
    if limited is not None and limited[0] < total:
        limit, used = limited
        total, available, source = limit, min(available, max(0, limit - used)), "this container's cgroup limit"
    return HostMemory(total, available, source)


def planned_host_memory(size: str) -> HostMemory:
    """--host-memory: another machine with that much RAM, all of it free."""
    amount = parse_size(size, "--host-memory")
    return HostMemory(amount, amount, f"--host-memory {size}")


def _cgroup(root: Path) -> tuple[int, int] | None:
    """(limit, used less reclaimable page cache) of the tightest memory cgroup over this process,
    from cgroup v2's unified tree or v1's memory controller; None: no limit."""
    try:
        lines = (root / "proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    base = root / "sys/fs/cgroup"
    for line in lines:
        number, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if number == "0" and controllers == "":  # v2
            return _tightest(base, path, "memory.max", "memory.current", "inactive_file")
        if "memory" in controllers.split(","):  # v1
            return _tightest(base / "memory", path, "memory.limit_in_bytes", "memory.usage_in_bytes",
                             "total_inactive_file")
    return None


def _tightest(base: Path, path: str, limit_file: str, usage_file: str, cache_key: str) -> tuple[int, int] | None:
    """Walk from the process's cgroup up to the root of the tree (inside a container the path may
    be the host's: then only the root's files are there), keeping the smallest limit."""
    best = None
    folder = base / path.strip("/")
    while True:
        limit, used = _number(folder / limit_file), _number(folder / usage_file)
        if limit is not None and limit < UNLIMITED and used is not None and (best is None or limit < best[0]):
            best = (limit, max(0, used - _stat(folder / "memory.stat", cache_key)))
        if folder == base or base not in folder.parents:
            return best
        folder = folder.parent


def _number(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # v2 says "max" where there is no limit


def _stat(path: Path, key: str) -> int:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key and value.strip().isdigit():
                return int(value)
    except OSError:
        pass
    return 0


def host_memory(override: str | None = None) -> HostMemory:
    """--host-memory where given, else this machine's."""
    return planned_host_memory(override) if override else read_host_memory()


def with_host(profile, memory: HostMemory):
    """`profile` with the host side `memory` gives it: a GPU profile's store takes what is usable
    (bounded by the profile's own host_bytes where a file sets one). A named CPU profile is a
    reference machine and stays one, unless --host-memory names another (80% of it for the model
    and its caches together, as this_cpu plans)."""
    from dataclasses import replace

    if profile.num_gpus == 0:
        if not memory.source.startswith("--host-memory"):
            return profile
        return replace(profile, gpu_bytes=int(0.8 * memory.total), host_bytes=int(0.8 * memory.total))
    return replace(profile, host_bytes=min(profile.host_bytes, memory.usable),
                   description=f"{profile.description}; host memory: {memory.describe()}")


def this_cpu(memory: HostMemory | None = None):
    """The shipped `cpu` profile with this machine's memory (its cgroup's where that is tighter) and
    cores, what a CPU run plans with unless --profile names one: 80% of the memory, which the
    model, its caches and an emulated host store share (the total, so two runs plan alike; what is
    free is checked before the caches are made: triforce.model.host_memory); rates as shipped
    until `profile tune`. memory: another machine's (--host-memory)."""
    from dataclasses import replace

    memory = memory or read_host_memory()
    usable = int(0.8 * memory.total)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    where = "this machine" if memory.source != "this container's cgroup limit" else "this container"
    if memory.source.startswith("--host-memory"):
        where = memory.source
    return replace(load_profile("cpu"), gpu_bytes=usable, host_bytes=usable, cpu_threads=cores, source="this machine",
                   description=f"CPU only, read from {where}: {format_size(usable)} usable (80% of its "
                               f"memory), {cores} cores; rates as shipped")
