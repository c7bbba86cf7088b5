"""The host-sync counter's bookkeeping: each synchronisation warning goes to the innermost phase
open when it was raised (torch raises them on CUDA; here the test raises them itself)."""
import warnings

import pytest
import torch

from triforce.decoding.sync_count import SYNC_WARNING, SyncCounter


def sync(times=1):
    for _ in range(times):
        warnings.warn(f"{SYNC_WARNING}", UserWarning)


def test_warnings_go_to_the_innermost_open_phase():
    counter = SyncCounter()
    counter.available = True
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        with counter.capturing(records):
            sync()                                   # outside any phase
            with counter.phase("full forward"):
                sync(2)
                with counter.phase("retrieval forward"):
                    sync(3)
                sync()                               # back in the outer phase
                warnings.warn("something else")      # not a sync: not counted
            with counter.phase("draft sample"):
                pass
    assert counter.counts == {"other": 1, "full forward": 3, "retrieval forward": 3}
    report = counter.report(tokens=7)
    assert report["total"] == 7 and report["per_token"] == 1.0
    assert list(report["by_phase"]) == ["full forward", "retrieval forward", "other"]


def test_phases_outside_a_recording_count_nothing():
    counter = SyncCounter()
    with pytest.warns(UserWarning), counter.phase("full forward"):
        sync()
    assert not counter.counts


def test_cpu_recording_reports_that_it_cannot_count():
    counter = SyncCounter()
    with counter.recording(torch.device("cpu")):
        with counter.phase("x"):
            pass
    assert counter.report(5) == "counted on CUDA only"
