"""The hybrid split on a GPU follows the passes as they ran (offload.hybrid.ShareTuner), checked
against the H200 campaign of 2026-11-28 (Llama2-7B-128K shapes, 32 layers): rates measured one at
a time (host attention 52.12 GB/s, link 55.19) gave the CPU 48.6% of ar's host KV; run together,
at 32K the halves took 215 ms a token where the link alone took 149 (ar-offload), and at 127K they
took 958 where it took 1071."""
import pytest

from triforce.offload.hybrid import HybridRates, ShareTuner

RATES = HybridRates(h2d_gbps=55.19, cpu_gbps=52.12, cpu_tflops=0.182)


class Clock:
    """A device's timed events: each pair's seconds, or None while its end has not happened."""

    def __init__(self):
        self.seconds = {}

    def seconds_between(self, start, end):
        return self.seconds.get((start, end))


def ar_token(tuner, clock, cpu_gb, cpu_s, device_gb, device_s, layers=32, done=True):
    tuner.share(1)
    for layer in range(layers):
        pair = (object(), object())
        if done:
            clock.seconds[pair] = device_s / layers
        tuner.timed(1, cpu_gb * 1e9 / layers, cpu_s / layers, device_gb * 1e9 / layers, *pair)


def test_the_share_starts_from_the_rates():
    assert ShareTuner(RATES, Clock()).share(1) == pytest.approx(52.12 / (52.12 + 55.19))


def test_halves_slower_than_the_link_alone_give_the_cpu_less_each_pass():
    """32K: the CPU attended 4.29 GB and the link carried 3.76 GB a token, both in 215 ms; the link
    alone would have moved the 8.05 GB in 146 ms."""
    clock = Clock()
    tuner = ShareTuner(RATES, clock)
    shares = []
    for _ in range(8):
        ar_token(tuner, clock, 4.29, 0.215, 3.76, 0.215)
        shares.append(tuner.share(1))
    assert shares[0] == pytest.approx(0.486 * 0.75, abs=1e-3) and shares == sorted(shares, reverse=True)
    assert shares[-1] < 0.05 and tuner.passes == 8


def test_halves_faster_than_the_link_alone_move_toward_balance():
    """127K: 28.99 GB by the CPU and 29.26 GB over the link in 958 ms, where the link alone would
    have taken 1055 ms: a win, and the halves already nearly balanced (30.3 and 30.5 GB/s)."""
    clock = Clock()
    tuner = ShareTuner(RATES, clock)
    ar_token(tuner, clock, 28.99, 0.958, 29.26, 0.958)
    balanced = 28.99 / (28.99 + 29.26)
    assert tuner.share(1) == pytest.approx(0.486 + 0.5 * (balanced - 0.486), abs=1e-3)
    before = tuner.share(1)
    ar_token(tuner, clock, 20.0, 0.8, 40.0, 0.7)  # a win, the CPU slower (25 GB/s against 57): it gives some back
    assert tuner.share(1) == pytest.approx(before + 0.5 * (25 / (25 + 40 / 0.7) - before), abs=1e-3)


def test_timings_not_yet_on_the_device_wait_for_a_later_pass():
    clock = Clock()
    tuner = ShareTuner(RATES, clock)
    ar_token(tuner, clock, 4.29, 0.215, 3.76, 0.215, done=False)
    assert tuner.share(1) == pytest.approx(0.486, abs=1e-3) and len(tuner.pending) == 32 and tuner.passes == 0
    for pair in [item[4:] for item in tuner.pending]:
        clock.seconds[pair] = 0.215 / 32
    assert tuner.share(1) < 0.4 and tuner.pending == []


def test_a_length_not_yet_timed_starts_where_the_timed_ones_moved():
    """At 32K on the H200 each verify width restarted from the rates' share (0.3-0.5 where the timed
    ones had settled near 0.12), and the hybrid's first 32 tokens ran 55.5 ms each against 34.5
    streamed: a new length now starts from the rates scaled as the last timed one moved."""
    clock = Clock()
    tuner = ShareTuner(RATES, clock)
    ar_token(tuner, clock, 4.29, 0.215, 3.76, 0.215)
    moved = tuner.share(1) / RATES.cpu_share(1)
    assert tuner.share(1) < 0.4 and tuner.share(16) == pytest.approx(RATES.cpu_share(16) * moved)
    tuner.observe(16, [(1e9, 0.01, 1e9, 0.02)] * 32)  # then each length follows its own passes
    assert tuner.share(1) == pytest.approx(RATES.cpu_share(1) * moved) and tuner.share(16) > RATES.cpu_share(16) * moved
