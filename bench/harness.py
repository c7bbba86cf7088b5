"""How the benchmarks time a step, in one place: the device synchronized around what is timed,
warm-up runs first (compiles, allocations, first copies), then either the median of separately
timed calls (what one call costs: kernels) or the mean of a back-to-back run (what a step costs
when the next is queued behind it, as in decoding)."""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on a CPU, where work is done when it returns)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


@dataclass(frozen=True)
class Timing:
    samples_ms: tuple[float, ...]

    @property
    def median_ms(self) -> float:
        return statistics.median(self.samples_ms)

    @property
    def spread(self) -> float:
        """(slowest - fastest) / median: how far one sample can be trusted."""
        return (max(self.samples_ms) - min(self.samples_ms)) / self.median_ms if self.median_ms else 0.0


def each_call(fn, device, repeats: int, warmup: int = 3) -> Timing:
    """Every call timed on its own, the device synchronized before and after each."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        sync(device)
        started = time.perf_counter()
        fn()
        sync(device)
        samples.append((time.perf_counter() - started) * 1e3)
    return Timing(tuple(samples))


def back_to_back_ms(fn, device, repeats: int, warmup: int = 3) -> float:
    """The mean of `repeats` calls queued one after another, synchronized once at each end."""
    for _ in range(warmup):
        fn()
    sync(device)
    started = time.perf_counter()
    for _ in range(repeats):
        fn()
    sync(device)
    return (time.perf_counter() - started) * 1e3 / repeats
