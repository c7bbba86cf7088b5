"""Issue 76: a program at a lower priority (nice > 0) beside us does not count as using our cores
when triforce decides how its idle kernel threads wait: the kernel hands its time to ours, so our
threads spin as on a quiet machine (a nice 19 busy loop cost 38% while they slept). Time at our
priority and above still counts. The cores' counters are read before and after a tenth of a second
(psutil.cpu_times, faked here): psutil 7.2's own percentages read such a window of a quiet machine as
90% busy, and threads slept where spinning ran 1.26x faster."""
from collections import namedtuple

import psutil

from triforce import thread_wait
from triforce.thread_wait import QUIET_CORES, cores_used_by_others, decide

Times = namedtuple("Times", "user nice system idle iowait irq softirq steal guest guest_nice")
START = Times(5000.0, 10.0, 300.0, 90000.0, 20.0, 0.0, 5.0, 7.0, 0.0, 10.0)  # seconds since boot


def _machine(monkeypatch, *windows):
    """Each core's counters grow by its window's seconds between the two readings."""
    after = [Times(*(a + b for a, b in zip(START, w))) for w in windows]
    calls = []

    def cpu_times(percpu):  # before, after, before, after, ... (one pair per reading)
        calls.append(percpu)
        return after if len(calls) % 2 == 0 else [START] * len(windows)
    monkeypatch.setattr(psutil, "cpu_times", cpu_times)
    monkeypatch.setattr(thread_wait.os, "sched_getaffinity", lambda pid: {0, 1})


def test_a_quiet_machine_over_a_tenth_of_a_second_is_quiet(monkeypatch):
    _machine(monkeypatch, Times(0.001, 0, 0.001, 0.098, 0, 0, 0, 0, 0, 0), Times(0, 0, 0, 0.1, 0, 0, 0, 0, 0, 0))
    assert 0.019 < cores_used_by_others() < 0.021
    assert decide({}, others=cores_used_by_others) == "spin"


def test_a_niced_busy_loop_leaves_the_cores_quiet(monkeypatch):
    # a niced guest's time is inside nice already (guest_nice): counted once
    _machine(monkeypatch, Times(0.001, 0.097, 0.001, 0.001, 0, 0, 0, 0, 0, 0.097), Times(0, 0, 0, 0.1, 0, 0, 0, 0, 0, 0))
    assert cores_used_by_others() < QUIET_CORES
    assert decide({}, others=cores_used_by_others) == "spin"


def test_a_busy_loop_at_our_priority_counts(monkeypatch):
    _machine(monkeypatch, Times(0.095, 0, 0.003, 0.002, 0, 0, 0, 0, 0, 0), Times(0, 0, 0, 0.09, 0.01, 0, 0, 0, 0, 0))
    assert 0.97 < cores_used_by_others() < 0.99  # disk waits are idle cores
    env = {}
    assert decide(env, others=cores_used_by_others) == "sleep" and env["OMP_WAIT_POLICY"] == "PASSIVE"


def test_cores_this_process_may_not_use_are_left_out(monkeypatch):
    busy = Times(0.1, 0, 0, 0, 0, 0, 0, 0, 0, 0)
    quiet = Times(0, 0, 0, 0.1, 0, 0, 0, 0, 0, 0)
    _machine(monkeypatch, quiet, quiet, busy, busy)
    assert cores_used_by_others() == 0.0


def test_a_core_whose_counters_did_not_move_counts_as_quiet(monkeypatch):
    still = Times(0, 0, 0, 0, 0, 0, 0, 0, 0, 0)
    _machine(monkeypatch, still, still)
    assert cores_used_by_others() == 0.0
