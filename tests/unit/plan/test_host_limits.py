"""Issue 74: host memory read from the machine that runs, its container's cgroup (v2 and v1)
included, less a margin that grows with the machine; named GPU profiles describe the card only."""
from collections import namedtuple

import pytest

from triforce.plan import host_limits
from triforce.plan.host_limits import GIB, read_host_memory, planned_host_memory, with_host
from triforce.plan.profiles import HOST_UNBOUNDED, list_profiles, load_profile

VM = namedtuple("svmem", "total available percent used free")  # psutil's virtual_memory() fields used here


@pytest.fixture
def machine(monkeypatch):
    """This process on a machine of `total` GiB with `available` free (psutil's answer)."""
    def set_memory(total_gib: float, available_gib: float):
        vm = VM(int(total_gib * GIB), int(available_gib * GIB), 0.0, 0, 0)
        monkeypatch.setattr("psutil.virtual_memory", lambda: vm)
    return set_memory


def _tree(root, cgroup_line: str, files: dict[str, str]):
    (root / "proc" / "self").mkdir(parents=True)
    (root / "proc" / "self" / "cgroup").write_text(cgroup_line + "\n")
    for path, text in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)


def test_a_cgroup_v2_limit_bounds_what_psutil_reports(tmp_path, machine):
    machine(64, 50)
    _tree(tmp_path, "0::/user.slice/job", {
        "sys/fs/cgroup/user.slice/job/memory.max": str(8 * GIB),
        "sys/fs/cgroup/user.slice/job/memory.current": str(3 * GIB),
        "sys/fs/cgroup/user.slice/job/memory.stat": f"anon 1\ninactive_file {GIB}\n",
        "sys/fs/cgroup/user.slice/memory.max": "max",
    })
    memory = read_host_memory(tmp_path)
    assert (memory.total, memory.available) == (8 * GIB, 6 * GIB)  # 8 less 3 used, 1 of it page cache
    assert memory.usable == 4 * GIB and "cgroup" in memory.source


def test_a_cgroup_v1_limit_is_found_from_inside_a_container(tmp_path, machine):
    """The process's path is the host's (/docker/abc), absent inside: the namespace root's files count."""
    machine(64, 50)
    _tree(tmp_path, "12:cpu:/x\n9:memory:/docker/abc", {
        "sys/fs/cgroup/memory/memory.limit_in_bytes": str(16 * GIB),
        "sys/fs/cgroup/memory/memory.usage_in_bytes": str(4 * GIB),
    })
    memory = read_host_memory(tmp_path)
    assert (memory.total, memory.available) == (16 * GIB, 12 * GIB)


def test_no_limit_leaves_the_machines_memory(tmp_path, machine):
    machine(64, 50)
    _tree(tmp_path, "9:memory:/", {"sys/fs/cgroup/memory/memory.limit_in_bytes": "9223372036854771712",
                                   "sys/fs/cgroup/memory/memory.usage_in_bytes": str(GIB)})
    assert (read_host_memory(tmp_path).total, read_host_memory(tmp_path).available) == (64 * GIB, 50 * GIB)
    assert read_host_memory(tmp_path / "nothing-here").total == 64 * GIB  # no /proc/self/cgroup


@pytest.mark.parametrize("size, margin_gib", [("16GiB", 2), ("64GiB", 6.4), ("256GiB", 25.6)])
def test_the_margin_grows_with_the_machine(size, margin_gib):
    memory = planned_host_memory(size)
    assert memory.margin == pytest.approx(margin_gib * GIB, rel=1e-6) and memory.usable == memory.total - memory.margin


def test_named_gpu_profiles_describe_the_card_only():
    """On 2026-11-28 every card's profile claimed 96-200 GiB of host memory: a 64 GB desktop
    passed the plan and failed at load."""
    for profile in list_profiles():
        if profile.num_gpus > 0:
            assert profile.host_bytes == HOST_UNBOUNDED, profile.name
    card = with_host(load_profile("rtx4090-24g"), planned_host_memory("64GB"))
    assert card.host_bytes == planned_host_memory("64GB").usable and "--host-memory 64GB" in card.description


def test_this_machines_reading_is_what_a_run_plans_with(monkeypatch, machine):
    import torch

    from triforce.app.plan_and_cache import resolve_profile

    machine(32, 20)
    monkeypatch.setattr(host_limits, "_cgroup", lambda root: None)
    monkeypatch.setattr(host_limits, "host_memory", lambda override=None: read_host_memory())  # not the suite's
    profile = resolve_profile("rtx4090-24g", torch.device("cpu"))
    assert profile.host_bytes == 20 * GIB - int(0.1 * 32 * GIB)  # available less 10% of the machine
