"""The benchmarks' one timing harness: warm-up calls are not timed, each_call times every call on
its own (median and spread), back_to_back_ms the mean of calls queued one after another."""
import time

import pytest
import torch

from triforce.bench.harness import Timing, back_to_back_ms, each_call


def test_each_call_times_every_call_after_the_warm_up():
    calls = []
    timing = each_call(lambda: calls.append(time.sleep(0.002 if len(calls) < 2 else 0.001)), torch.device("cpu"),
                       repeats=4, warmup=2)
    assert len(calls) == 6 and len(timing.samples_ms) == 4  # the two slower warm-up calls are not in it
    assert 1.0 <= timing.median_ms < 50 and timing.spread >= 0


def test_the_median_and_spread_of_samples():
    t = Timing((2.0, 4.0, 3.0))
    assert t.median_ms == 3.0 and t.spread == pytest.approx(2 / 3)


def test_back_to_back_is_the_mean_of_the_timed_calls():
    calls = []
    ms = back_to_back_ms(lambda: calls.append(time.sleep(0.001)), torch.device("cpu"), repeats=5, warmup=1)
    assert len(calls) == 6 and 1.0 <= ms < 50
