"""The hybrid split of a pass's host KV: PCIe streams some blocks to the device while CPU threads
attend over the others in place (triforce.kernels.cpu.attention.host), so the host KV is read at the
link's rate plus the CPU's instead of the link's alone.

The two halves finish together when the CPU takes share C / (P + C) of the bytes, P the pinned
host-to-device bandwidth and C the CPU attention rate for the pass's query rows: a decoding step's
one query row per KV head (per query head sharing it) is bound by reading memory, a verify pass's
rows by arithmetic (4 x head dim FLOPs per row and key against 2 x head dim x element bytes read:
rows / element bytes FLOP per byte), so C falls as the pass grows. Both rates are the profile's,
measured by `triforce profile tune`."""
from __future__ import annotations

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
        """The split's rates for this hardware (offload.cost_model.Hardware) and model
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

    def start(self, fn, q: torch.Tensor, *args, **kwargs):
        """fn(q on the host, *args, **kwargs) -> host tensors; returns a function giving them on the device."""
        if self.device.type != "cuda":
            result = fn(q.to("cpu"), *args, **kwargs)
            return lambda: result
        q_host = torch.empty(q.shape, dtype=q.dtype, pin_memory=True)
        q_host.copy_(q, non_blocking=True)
        ready = self.streams.event()
        self.streams.record(ready, self.streams.current())
        if self._pool is None:
            from concurrent.futures import ThreadPoolExecutor
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="triforce-host-attention")
        future = self._pool.submit(self._run, numba.get_num_threads(), ready, fn, q_host, args, kwargs)

        def on_device():
            pinned = [torch.empty(p.shape, dtype=p.dtype, pin_memory=True).copy_(p) for p in future.result()]
            return tuple(p.to(self.device, non_blocking=True) for p in pinned)
        return on_device

    def _run(self, threads: int, ready, fn, q_host, args, kwargs):
        numba.set_num_threads(threads)
        self.streams.host_wait(ready)  # q has reached pinned memory
        return fn(q_host, *args, **kwargs)
