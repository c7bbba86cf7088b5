"""The hybrid split of a pass's host KV: PCIe streams some blocks to the device while CPU threads
attend over the others in place (triforce.kernels.cpu.attention.host), so the host KV is read at the
link's rate plus the CPU's instead of the link's alone.

The two halves finish together when the CPU takes share C / (P + C) of the bytes, P the pinned
host-to-device bandwidth and C the CPU attention rate for the pass's query rows: a decoding step's
one query row per KV head (per query head sharing it) is bound by reading memory, a verify pass's
rows by arithmetic (4 x head dim FLOPs per row and key against 2 x head dim x element bytes read:
rows / element bytes FLOP per byte), so C falls as the pass grows. Both rates are the profile's,
measured by `triforce profile tune`, each alone; running together they share the host's memory,
and the CPU's part waits for each layer's queries (each ran at a fraction of its rate alone on the
H200: bench/history/2026-11-28-gpu-campaign-h200.md).
So on a GPU the split follows the passes as they run (ShareTuner): each layer's two halves are
timed, the CPU on the host's clock from its queries' arrival, the device by events from the same
point to its streamed blocks' last partial, and the share moves toward the one that would have
made them end together."""
from __future__ import annotations

import time
from dataclasses import dataclass

import numba
import torch

from triforce.offload.streams import streams_for


@dataclass(frozen=True)
class HybridRates:
    h2d_gbps: float             # pinned host-to-device copies
    cpu_gbps: float             # CPU attention over host KV, one query row per KV head (memory-bound)
    cpu_tflops: float | None    # its arithmetic rate with many rows (None: memory-bound at any size)
    group: int = 1              # query heads per KV head
    element_bytes: int = 2

    @classmethod
    def of(cls, hw, costs) -> "HybridRates | None":
        """The split's rates for this hardware (plan.cost_model.Hardware) and model
        (StepCosts); None where the hardware has no CPU attention rates (all streamed)."""
        if hw.cpu_attention_gbps is None:
            return None
        return cls(hw.h2d_gbps, hw.cpu_attention_gbps, hw.cpu_attention_tflops, costs.kv_group, costs.element_bytes)

    def cpu_rate_gbps(self, tokens: int) -> float:
        """GB/s of host KV the CPU attends for a pass of `tokens` new tokens."""
        if self.cpu_tflops is None:
            return self.cpu_gbps
        flop_per_byte = self.group * tokens / self.element_bytes
        return min(self.cpu_gbps, self.cpu_tflops * 1000 / flop_per_byte)

    def cpu_share(self, tokens: int) -> float:
        """The fraction of the host KV bytes the CPU should take, so both halves end together."""
        cpu = self.cpu_rate_gbps(tokens)
        return cpu / (cpu + self.h2d_gbps)

    def host_ms(self, host_bytes: float, tokens: int) -> float:
        """The time of the host KV's part of a pass: both halves at once."""
        return host_bytes / ((self.h2d_gbps + self.cpu_rate_gbps(tokens)) * 1e6)


class ShareTuner:
    """The CPU's share for passes of each length, moved after each pass by its timed layers: toward
    the share that would have ended both halves together, or, where the halves took longer than the
    link alone would have taken for all of it (they share the host's memory), toward less CPU."""

    STEP = 0.5      # how far one pass moves the share (the halves' times are noisy)
    PENDING = 1024  # layers' device timings awaited at most (older ones are dropped)

    def __init__(self, rates: HybridRates, streams):
        self.rates, self.streams = rates, streams
        self.shares: dict[int, float] = {}
        # a length not yet timed starts from the rates' share times this: what the last timed pass
        # made of its own (each new verify width restarted from the rates' optimistic share:
        # bench/history/2026-11-28-gpu-campaign-h200-second.md)
        self.learned = 1.0
        self.pending: list[tuple] = []  # (tokens, cpu bytes, cpu seconds, device bytes, start event, end event)
        self.passes = 0                 # passes that moved a share

    def share(self, tokens: int) -> float:
        self._harvest()
        return self._share(tokens)

    def _share(self, tokens: int) -> float:
        return self.shares.get(tokens, min(1.0, self.rates.cpu_share(tokens) * self.learned))

    def timed(self, tokens: int, cpu_bytes: int, cpu_seconds: float, device_bytes: int, start, end) -> None:
        """A layer's two halves: the CPU's done, the device's read once its end event has happened."""
        self.pending = [*self.pending[-self.PENDING + 1:], (tokens, cpu_bytes, cpu_seconds, device_bytes, start, end)]

    def _harvest(self) -> None:
        waiting, done = [], {}
        for item in self.pending:
            seconds = self.streams.seconds_between(item[4], item[5])
            if seconds is None:
                waiting.append(item)
            else:
                done.setdefault(item[0], []).append((*item[1:4], seconds))
        self.pending = waiting
        for tokens, layers in done.items():
            self.observe(tokens, layers)

    def observe(self, tokens: int, layers: list[tuple[int, float, int, float]]) -> None:
        """layers: (cpu bytes, cpu seconds, device bytes, device seconds) of each layer timed."""
        cpu_bytes, cpu_s, device_bytes, device_s = (sum(layer[i] for layer in layers) for i in range(4))
        if min(cpu_bytes, cpu_s, device_bytes, device_s) <= 0:
            return
        share = self._share(tokens)
        hybrid_s = sum(max(layer[1], layer[3]) for layer in layers)
        if hybrid_s > (cpu_bytes + device_bytes) / (self.rates.h2d_gbps * 1e9):
            target = share / 2  # streaming it all would have been faster
        else:
            cpu, device = cpu_bytes / cpu_s, device_bytes / device_s
            target = cpu / (cpu + device)
        self.shares[tokens] = share + self.STEP * (target - share)
        self.learned = self.shares[tokens] / self.rates.cpu_share(tokens)
        self.passes += 1


def split_blocks(blocks: tuple[int, ...], share: float) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(blocks the CPU attends in place, blocks streamed): the oldest `share` of them to the CPU,
    the newest always streamed (the last passes' writes land there, still on the copy stream)."""
    in_place = min(round(len(blocks) * share), max(len(blocks) - 1, 0))
    return blocks[:in_place], blocks[in_place:]


class CpuWorker:
    """Runs the CPU's share of a layer beside the device's work: on CUDA a worker thread (the
    numba kernel releases the GIL while the main thread launches the layer's kernels), on a CPU
    device at once (one set of cores: nothing to overlap).

    On CUDA the calling thread never waits for the device: q goes to pinned memory by an
    asynchronous copy and an event, which the worker waits for; the CPU's results go back by
    asynchronous copies from pinned memory. The caller waits only for the worker (a host wait),
    once per layer, when it merges the CPU's part. numba's thread count is per thread: the worker
    takes the caller's (--threads)."""

    def __init__(self, device: torch.device, streams=None):
        self.device = torch.device(device)
        self.streams = streams if streams is not None else streams_for(self.device)
        self._pool = None

    def start(self, fn, q: torch.Tensor, *args, tuner: ShareTuner | None = None, cpu_bytes: int = 0, **kwargs):
        """fn(q on the host, *args, **kwargs) -> host tensors; returns a function of the device's
        bytes of the layer giving them on the device (and, with a tuner, timing both halves)."""
        if self.device.type != "cuda":
            result = fn(q.to("cpu"), *args, **kwargs)
            return lambda device_bytes=0: result
        q_host = torch.empty(q.shape, dtype=q.dtype, pin_memory=True)
        q_host.copy_(q, non_blocking=True)
        ready = (self.streams.timing_event() if tuner is not None else None) or self.streams.event()
        self.streams.record(ready, self.streams.current())
        if self._pool is None:
            from concurrent.futures import ThreadPoolExecutor
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="triforce-host-attention")
        future = self._pool.submit(self._run, numba.get_num_threads(), ready, fn, q_host, args, kwargs)

        def on_device(device_bytes: int = 0):
            end = self.streams.timing_event() if tuner is not None else None
            if end is not None:  # the device's half is launched: its end, timed from the queries' arrival
                self.streams.record(end, self.streams.current())
            result, seconds = future.result()
            if end is not None:
                tuner.timed(q.shape[2], cpu_bytes, seconds, device_bytes, ready, end)
            pinned = [torch.empty(p.shape, dtype=p.dtype, pin_memory=True).copy_(p) for p in result]
            return tuple(p.to(self.device, non_blocking=True) for p in pinned)
        return on_device

    def _run(self, threads: int, ready, fn, q_host, args, kwargs):
        numba.set_num_threads(threads)
        self.streams.host_wait(ready)  # q has reached pinned memory
        started = time.perf_counter()
        result = fn(q_host, *args, **kwargs)
        return result, time.perf_counter() - started
