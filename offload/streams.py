"""The stream and event interface the prefetcher speaks, with its two real implementations.

`CudaStreams` is CUDA: a copy stream beside the compute stream, events to order them, copies with
non_blocking=True (their host side must be pinned and contiguous). `SyncStreams` is a device
without streams (the CPU): everything runs in program order, copies are plain copies. Tests put
a checked fake of the same interface in their place (tests/cuda_semantics), so the prefetcher's
one schedule runs unchanged under all three."""
from __future__ import annotations

import contextlib

import torch


class SyncStreams:
    """No streams: every operation happens when it is called."""

    asynchronous = False

    def stream(self, purpose: str = "copy"):
        """A new stream (purpose names it where a checker reports)."""
        return None

    def current(self):
        return None

    def event(self):
        return None

    def record(self, event, stream) -> None:
        pass

    def wait_event(self, stream, event) -> None:
        pass

    def wait_stream(self, stream, other) -> None:
        pass

    def on(self, stream):
        return contextlib.nullcontext()

    def worker(self):
        """A context, made on the calling thread, that a worker thread enters to issue work to
        this device as the caller would."""
        return contextlib.nullcontext()

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    def keep_alive(self, tensor: torch.Tensor, stream) -> None:
        pass

    def synchronize(self, stream) -> None:
        pass

    def host_wait(self, event) -> None:
        """The calling thread waits until `event` has happened (a worker thread's wait: the
        thread that launches the device's work never calls it)."""

    def timing_event(self):
        """An event that can be timed against another (None: this device keeps no times)."""
        return None

    def seconds_between(self, start, end) -> float | None:
        """Device seconds from `start` to `end`, once `end` has happened; None before (never waits)."""
        return None


class CudaStreams(SyncStreams):
    """CUDA streams and events of one device."""

    asynchronous = True

    def __init__(self, device: torch.device):
        self.device = torch.device(device)

    def stream(self, purpose: str = "copy"):
        return torch.cuda.Stream(self.device)

    def current(self):
        return torch.cuda.current_stream(self.device)

    def event(self):
        return torch.cuda.Event()

    def record(self, event, stream) -> None:
        event.record(stream)

    def wait_event(self, stream, event) -> None:
        stream.wait_event(event)

    def wait_stream(self, stream, other) -> None:
        stream.wait_stream(other)

    def on(self, stream):
        return torch.cuda.stream(stream)

    def worker(self):
        return torch.cuda.device(self.device)  # CUDA's current device is per thread

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src, non_blocking=True)

    def keep_alive(self, tensor: torch.Tensor, stream) -> None:
        tensor.record_stream(stream)  # the caching allocator must not reuse it before `stream` is done

    def synchronize(self, stream) -> None:
        stream.synchronize()

    def host_wait(self, event) -> None:
        event.synchronize()

    def timing_event(self):
        return torch.cuda.Event(enable_timing=True)

    def seconds_between(self, start, end) -> float | None:
        return start.elapsed_time(end) / 1000 if end.query() else None


def streams_for(device: torch.device) -> SyncStreams:
    """The real interface for `device`."""
    return CudaStreams(device) if torch.device(device).type == "cuda" else SyncStreams()
