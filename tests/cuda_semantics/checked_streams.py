"""A checked fake of the stream/event interface (triforce.offload.streams), for CPU tests.

It runs the prefetcher's CUDA schedule on CPU tensors and enforces what CUDA would:

- Order. Every stream and the host thread carry a vector clock; recording an event stamps the
  stream's clock, waiting on it merges the stamp, synchronize() lets the host see a stream, and an
  operation issued by the host carries everything the host has seen. Every access to memory that
  crossed a copy (staging buffers, the host store) is checked against the earlier conflicting
  accesses: a read of a buffer before waiting on its copy's event, an overwrite before its reader
  released it, or the CPU reading host memory that a copy may still be filling raises
  StreamOrderError naming both lines.
- Poison. A copy's target holds NaN until someone ordered after it reads it: a missing wait
  shows up as NaN output even where no check looks.
- Copy discipline. Every copy's host side must be pinned (registered by allocate_host) and
  contiguous, else CopyDisciplineError.

Compute reads are seen through a TorchFunctionMode active inside `watching()`. With follow_all, every
tensor a torch call makes or writes in place is followed too (not only what crossed a copy), so
work handed between streams (drafting ahead of a verify) is checked as copies are. Memory that was
freed loses its history, and a fresh allocation starts with none, whatever address it lands on:
CUDA's caching allocator hands a block back only to the stream it was allocated on, after the
streams record_stream named (record_stream hazards are not modelled).

As on CUDA, the current stream is per thread (a new thread starts on the compute stream, the
default one), and work a thread issues through `worker()` is watched as the caller's is."""
from __future__ import annotations

import contextlib
import linecache
import os
import sys
import threading
import time
from dataclasses import dataclass, field

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode

from card_tensors import active, set_quiet
from triforce.pinned import is_registered

HERE = os.path.abspath(__file__)
# functions that make views or read metadata: no data is read
NO_DATA = {"__getitem__", "permute", "view", "transpose", "narrow", "select", "unsqueeze", "squeeze", "expand",
           "split", "chunk", "unbind", "__get__", "size", "dim", "stride", "data_ptr", "untyped_storage",
           "element_size", "numel", "is_contiguous", "is_pinned", "storage_offset", "__len__", "__format__",
           "__repr__", "record_stream", "__hash__", "t", "as_strided", "__setstate__", "__reduce_ex__",
           "requires_grad_", "is_floating_point", "__index__"}


class StreamOrderError(AssertionError):
    """Two accesses to the same memory that no event, stream wait or synchronize orders."""


class CopyDisciplineError(AssertionError):
    """An asynchronous copy whose host side is not pinned or not contiguous."""


class FakeStream:
    def __init__(self, name: str, index: int):
        self.name, self.index = name, index
        self.clock: dict[int, int] = {index: 0}


class FakeEvent:
    def __init__(self, timing: bool = False):
        self.clock: dict[int, int] | None = None  # None until recorded: waiting on it is a no-op
        self.timing = timing
        self.at: float | None = None  # the host's clock when recorded (work here runs as it is issued)


@dataclass
class Access:
    lo: int
    hi: int
    write: bool
    owner: FakeStream
    stamp: dict
    where: str


@dataclass
class Region:
    kind: str                       # "host" (pinned memory) or "device"
    storage: StorageWeakRef         # expires when the memory is freed: its address may be handed out again
    accesses: list = field(default_factory=list)


def _merge(into: dict, other: dict) -> None:
    for k, v in other.items():
        if into.get(k, 0) < v:
            into[k] = v


def _where() -> str:
    """The innermost line of triforce (or a test) that led here, outside this file and torch."""
    frame = sys._getframe(1)
    while frame is not None:
        name = os.path.abspath(frame.f_code.co_filename)
        if name != HERE and f"{os.sep}torch{os.sep}" not in name and "contextlib" not in name \
                and "threading" not in name and "concurrent" not in name:
            line = linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()
            return f"{frame.f_code.co_filename}:{frame.f_lineno} ({line})"
        frame = frame.f_back
    return "?"


def _span(t: torch.Tensor) -> tuple[int, int]:
    """Bytes [lo, hi) that a view may touch."""
    lo = t.data_ptr()
    if t.numel() == 0:
        return lo, lo
    extent = sum((size - 1) * abs(stride) for size, stride in zip(t.shape, t.stride())) + 1
    return lo, lo + extent * t.element_size()


class CheckedStreams:
    asynchronous = True

    def __init__(self, follow_all: bool = False):
        self._streams: list[FakeStream] = []
        self.compute = self._new("compute stream")
        self.host = self._new("host thread")
        self._thread = threading.local()         # .current stream, .internal (the fake's own calls)
        self._lock = threading.RLock()           # threads share the clocks and the regions
        self.follow_all = follow_all
        self._regions: dict[int, Region] = {}   # storage data_ptr -> what crossed a copy (or any, follow_all)
        self._pending: list[tuple] = []          # (owner, stamp, dst, value): copies not yet visible
        self.copies = 0
        self.checked_accesses = 0
        self.accesses_by: dict[str, int] = {}    # stream name -> accesses checked on it

    @property
    def _current(self) -> FakeStream:
        return getattr(self._thread, "current", self.compute)

    @_current.setter
    def _current(self, stream: FakeStream) -> None:
        self._thread.current = stream

    @property
    def _internal(self) -> bool:
        return getattr(self._thread, "internal", False)

    @_internal.setter
    def _internal(self, value: bool) -> None:
        self._thread.internal = value
        set_quiet(value)  # the copies this fake stands for are non_blocking and pinned: no sync

    # ---- the interface ------------------------------------------------------------------
    def stream(self, purpose: str = "copy") -> FakeStream:
        return self._new(f"{purpose} stream {len(self._streams) - 1}")

    def _new(self, name: str) -> FakeStream:
        s = FakeStream(name, len(self._streams))
        self._streams.append(s)
        return s

    def current(self) -> FakeStream:
        return self._current

    def event(self) -> FakeEvent:
        return FakeEvent()

    def record(self, event: FakeEvent, stream: FakeStream) -> None:
        with self._lock:
            self._issue(stream)
            event.clock = dict(stream.clock)
            event.at = time.perf_counter()

    def timing_event(self) -> FakeEvent:
        return FakeEvent(timing=True)

    def seconds_between(self, start: FakeEvent, end: FakeEvent) -> float | None:
        if not (start.timing and end.timing):  # CUDA refuses to time events made without timing
            raise RuntimeError("Both events must be created with argument 'enable_timing=True'.")
        if start.at is None or end.at is None:
            raise RuntimeError("Both events must be recorded before calculating elapsed time.")
        return end.at - start.at

    def wait_event(self, stream: FakeStream, event: FakeEvent) -> None:
        with self._lock:
            if event.clock is not None:
                _merge(stream.clock, event.clock)

    def wait_stream(self, stream: FakeStream, other: FakeStream) -> None:
        with self._lock:
            _merge(stream.clock, other.clock)

    @contextlib.contextmanager
    def on(self, stream: FakeStream):
        previous, self._current = self._current, stream
        try:
            yield
        finally:
            self._current = previous

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        with self._lock:
            self._copy(dst, src, _where())

    def worker(self):
        """What a worker thread enters: the caller's torch function modes (this fake's watch, a
        fake card's placement), and the compute stream current, as a new CUDA thread has."""
        modes = torch.overrides._get_current_function_mode_stack()
        fake = self

        @contextlib.contextmanager
        def entered():
            fake._current = fake.compute
            with contextlib.ExitStack() as stack:
                for mode in modes:
                    stack.enter_context(mode)
                yield
        return entered()

    def _copy(self, dst: torch.Tensor, src: torch.Tensor, where: str) -> None:
        host = [t for t in (dst, src) if is_registered(t)]
        if not host:
            raise CopyDisciplineError(f"asynchronous copy with no pinned host side at {where}")
        for t in host:
            if not t.is_contiguous():
                raise CopyDisciplineError(f"asynchronous copy from/to a non-contiguous host view "
                                          f"{tuple(t.shape)} strides {t.stride()} at {where}")
        # Track the pinned side and a device target (a staging buffer, alive as long as the cache).
        # A device source is a temporary whose lifetime record_stream guards; its address may be
        # reused by the next allocation, so it is not tracked, unless follow_all follows it already
        # (a buffer the code reuses: its next write must wait for the copy's read).
        self._region(dst, "host" if is_registered(dst) else "device")
        if is_registered(src):
            self._region(src, "host")
        owner = self._current
        if is_registered(src) or self._tracked(src) is not None:  # a device source followed (follow_all)
            self._access(owner, src, False, where)
        stamp = self._access(owner, dst, True, where)
        self._internal = True
        try:
            value = src.clone()
            if dst.is_floating_point():
                dst.fill_(float("nan"))
            else:
                dst.copy_(value)
        finally:
            self._internal = False
        self._pending.append((owner, stamp, dst, value))
        self.copies += 1

    def keep_alive(self, tensor: torch.Tensor, stream: FakeStream) -> None:
        pass

    def host_wait(self, event: FakeEvent) -> None:
        with self._lock:
            if event.clock is not None:
                _merge(self.host.clock, event.clock)
            self._visible(self.host)  # what the host waited for is in memory now, for readers torch never sees

    def synchronize(self, stream: FakeStream) -> None:
        card = active()
        if card is not None:  # the host waits for the copy stream: a sync, as on a card
            card._sync("Stream.synchronize")
        with self._lock:
            if stream is not None:
                _merge(self.host.clock, stream.clock)
            self._visible(self.host)

    # ---- checking -----------------------------------------------------------------------
    def _tracked(self, t: torch.Tensor) -> Region | None:
        """t's memory's history, if it crossed a copy (or follow_all) since it was allocated."""
        key = t.untyped_storage().data_ptr()
        region = self._regions.get(key)
        if region is not None and region.storage.expired():
            del self._regions[key]  # freed since; the address now belongs to new memory
            return None
        return region

    def _region(self, t: torch.Tensor, kind: str) -> Region:
        region = self._tracked(t)
        if region is None or region.kind != kind:
            region = Region(kind, StorageWeakRef(t.untyped_storage()))
            self._regions[t.untyped_storage().data_ptr()] = region
        return region

    def _issue(self, owner: FakeStream) -> dict:
        """An operation on `owner`: issued by the host, so after all the host has seen."""
        if owner is not self.host:
            _merge(owner.clock, self.host.clock)
        owner.clock[owner.index] = owner.clock.get(owner.index, 0) + 1
        return dict(owner.clock)

    def _visible(self, owner: FakeStream) -> None:
        """Apply the pending copies `owner` is ordered after (its view of memory)."""
        keep = []
        for copier, stamp, dst, value in self._pending:
            if stamp[copier.index] <= owner.clock.get(copier.index, 0):
                self._internal = True
                try:
                    dst.copy_(value)
                finally:
                    self._internal = False
            else:
                keep.append((copier, stamp, dst, value))
        self._pending = keep

    def _access(self, owner: FakeStream, t: torch.Tensor, write: bool, where: str) -> dict:
        region = self._tracked(t)
        stamp = self._issue(owner)
        self._visible(owner)
        lo, hi = _span(t)
        for prior in region.accesses:
            if prior.owner is owner or not (prior.write or write) or prior.hi <= lo or hi <= prior.lo:
                continue
            if prior.stamp[prior.owner.index] > owner.clock.get(prior.owner.index, 0):
                raise StreamOrderError(
                    f"{'write' if write else 'read'} of {region.kind} memory on the {owner.name} at {where} "
                    f"is not ordered after the {'write' if prior.write else 'read'} on the {prior.owner.name} "
                    f"at {prior.where} (a missing event wait, stream wait or synchronize)")
        # forget accesses every party has seen: they can no longer race
        region.accesses = [a for a in region.accesses
                           if any(s.clock.get(a.owner.index, 0) < a.stamp[a.owner.index] for s in self._streams)]
        region.accesses.append(Access(lo, hi, write, owner, stamp, where))
        self.checked_accesses += 1
        self.accesses_by[owner.name] = self.accesses_by.get(owner.name, 0) + 1
        return stamp

    def _on_torch_call(self, func, args, kwargs) -> None:
        with self._lock:
            if self._internal or getattr(func, "__name__", "") in NO_DATA:
                return
            tensors, writes = [], set()
            name = getattr(func, "__name__", "")
            for i, a in enumerate(list(args) + list(kwargs.values())):
                for t in (a if isinstance(a, (list, tuple)) else (a,)):
                    if not isinstance(t, torch.Tensor):
                        continue
                    written = i == 0 and (name.endswith("_") or name == "__setitem__")
                    if written and self.follow_all:
                        self._region(t, "device")
                    if self._tracked(t) is not None:
                        tensors.append(t)
                        if written:
                            writes.add(id(t))
            if isinstance(kwargs.get("out"), torch.Tensor):
                if self.follow_all:
                    self._region(kwargs["out"], "device")
                    tensors.append(kwargs["out"])
                writes.add(id(kwargs["out"]))
            if not tensors:
                return
            kinds = {self._tracked(t).kind for t in tensors}
            # the CPU touching only pinned memory, outside any stream, is the host thread itself
            owner = self.host if kinds == {"host"} and self._current is self.compute else self._current
            where = _where()
            for t in tensors:
                self._access(owner, t, id(t) in writes, where)

    def _on_torch_result(self, func, args, kwargs, result) -> None:
        """follow_all: a tensor the call allocated is written by the current stream."""
        outputs = result if isinstance(result, (list, tuple)) else (result,)
        with self._lock:
            if self._internal or getattr(func, "__name__", "") in NO_DATA:
                return
            inputs = {t.untyped_storage().data_ptr() for a in list(args) + list(kwargs.values())
                      for t in (a if isinstance(a, (list, tuple)) else (a,)) if isinstance(t, torch.Tensor)}
            for t in outputs:
                if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                    continue
                key = t.untyped_storage().data_ptr()
                region = self._tracked(t)
                if key in inputs or region is not None and region.kind == "host":
                    continue  # a view or the input itself; pinned memory is tracked by copies
                self._regions[key] = Region("device", StorageWeakRef(t.untyped_storage()))  # fresh: no history
                self._access(self._current, t, True, _where())

    def device_synchronize(self) -> None:
        """torch.cuda.synchronize: the host waits for every stream, so it has seen them all."""
        with self._lock:
            for stream in self._streams:
                _merge(self.host.clock, stream.clock)
            self._visible(self.host)

    @contextlib.contextmanager
    def watching(self):
        """Check every torch call in this block against the streams' order (torch.cuda.synchronize
        included: it orders the host after every stream, as on a card)."""
        fake = self
        real_synchronize = torch.cuda.synchronize

        def synchronize(device=None):
            real_synchronize(device)  # raises without a card, as torch does; counted as a sync on the simulated one
            fake.device_synchronize()

        class Mode(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                fake._on_torch_call(func, args, kwargs)
                result = func(*args, **kwargs)
                if fake.follow_all:
                    fake._on_torch_result(func, args, kwargs, result)
                return result

        torch.cuda.synchronize = synchronize
        try:
            with Mode():
                yield self
        finally:
            torch.cuda.synchronize = real_synchronize
