"""Issue 76: a program at a lower priority (nice > 0) beside us does not count as using our cores
when triforce decides how its idle kernel threads wait: the kernel hands its time to ours, so our
threads spin as on a quiet machine (a nice 19 busy loop cost 38% while they slept). Time at our
priority and above still counts. psutil's per-core shares stand in for the machine's."""
from collections import namedtuple

import psutil

from triforce import thread_wait
from triforce.thread_wait import QUIET_CORES, cores_used_by_others, decide

Times = namedtuple("Times", "user nice system idle iowait irq softirq steal guest guest_nice")


def _machine(monkeypatch, *cores):
    monkeypatch.setattr(psutil, "cpu_times_percent", lambda interval, percpu: list(cores))
    monkeypatch.setattr(thread_wait.os, "sched_getaffinity", lambda pid: {0, 1})


def test_a_niced_busy_loop_leaves_the_cores_quiet(monkeypatch):
    _machine(monkeypatch, Times(1, 97, 1, 1, 0, 0, 0, 0, 0, 97), Times(0, 0, 0, 100, 0, 0, 0, 0, 0, 0))
    assert cores_used_by_others() < QUIET_CORES
    assert decide({}, others=cores_used_by_others) == "spin"


def test_a_busy_loop_at_our_priority_counts(monkeypatch):
    _machine(monkeypatch, Times(95, 0, 3, 2, 0, 0, 0, 0, 0, 0), Times(0, 0, 0, 90, 10, 0, 0, 0, 0, 0))
    assert 0.97 < cores_used_by_others() < 0.99  # disk waits are idle cores
    env = {}
    assert decide(env, others=cores_used_by_others) == "sleep" and env["OMP_WAIT_POLICY"] == "PASSIVE"


def test_cores_this_process_may_not_use_are_left_out(monkeypatch):
    busy = Times(100, 0, 0, 0, 0, 0, 0, 0, 0, 0)
    _machine(monkeypatch, Times(0, 0, 0, 100, 0, 0, 0, 0, 0, 0), Times(0, 0, 0, 100, 0, 0, 0, 0, 0, 0), busy, busy)
    assert cores_used_by_others() == 0.0
