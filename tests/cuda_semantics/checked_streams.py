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

Compute reads are seen through a TorchFunctionMode active inside `watching()`."""
from __future__ import annotations

import contextlib
import os
import traceback
from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode

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
    def __init__(self):
        self.clock: dict[int, int] | None = None  # None until recorded: waiting on it is a no-op


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
    accesses: list = field(default_factory=list)


def _merge(into: dict, other: dict) -> None:
    for k, v in other.items():
        if into.get(k, 0) < v:
            into[k] = v


def _where() -> str:
    """The innermost line of triforce (or a test) that led here, outside this file and torch."""
    for frame in reversed(traceback.extract_stack()[:-1]):
        name = os.path.abspath(frame.filename)
        if name != HERE and f"{os.sep}torch{os.sep}" not in name and "contextlib" not in name:
            return f"{frame.filename}:{frame.lineno} ({frame.line})"
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

    def __init__(self):
        self._streams: list[FakeStream] = []
        self.compute = self.stream("compute stream")
        self.host = self.stream("host thread")
        self._current = self.compute
        self._regions: dict[int, Region] = {}   # storage data_ptr -> what crossed a copy
        self._pending: list[tuple] = []          # (owner, stamp, dst, value): copies not yet visible
        self._internal = False
        self.copies = 0
        self.checked_accesses = 0

    # ---- the interface ------------------------------------------------------------------
    def stream(self, name: str | None = None) -> FakeStream:
        s = FakeStream(name or f"copy stream {len(self._streams) - 1}", len(self._streams))
        self._streams.append(s)
        return s

    def current(self) -> FakeStream:
        return self._current

    def event(self) -> FakeEvent:
        return FakeEvent()

    def record(self, event: FakeEvent, stream: FakeStream) -> None:
        self._issue(stream)
        event.clock = dict(stream.clock)

    def wait_event(self, stream: FakeStream, event: FakeEvent) -> None:
        if event.clock is not None:
            _merge(stream.clock, event.clock)

    def wait_stream(self, stream: FakeStream, other: FakeStream) -> None:
        _merge(stream.clock, other.clock)

    @contextlib.contextmanager
    def on(self, stream: FakeStream):
        previous, self._current = self._current, stream
        try:
            yield
        finally:
            self._current = previous

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        where = _where()
        host = [t for t in (dst, src) if is_registered(t)]
        if not host:
            raise CopyDisciplineError(f"asynchronous copy with no pinned host side at {where}")
        for t in host:
            if not t.is_contiguous():
                raise CopyDisciplineError(f"asynchronous copy from/to a non-contiguous host view "
                                          f"{tuple(t.shape)} strides {t.stride()} at {where}")
        # Track the pinned side and a device target (a staging buffer, alive as long as the cache).
        # A device source is a temporary whose lifetime record_stream guards; its address may be
        # reused by the next allocation, so it is not tracked.
        self._region(dst, "host" if is_registered(dst) else "device")
        if is_registered(src):
            self._region(src, "host")
        owner = self._current
        if is_registered(src):
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

    def synchronize(self, stream: FakeStream) -> None:
        if stream is not None:
            _merge(self.host.clock, stream.clock)

    # ---- checking -----------------------------------------------------------------------
    def _region(self, t: torch.Tensor, kind: str) -> Region:
        key = t.untyped_storage().data_ptr()
        if key not in self._regions:
            self._regions[key] = Region(kind)
        return self._regions[key]

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
        region = self._regions[t.untyped_storage().data_ptr()]
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
        return stamp

    def _on_torch_call(self, func, args, kwargs) -> None:
        if self._internal or getattr(func, "__name__", "") in NO_DATA:
            return
        tensors, writes = [], set()
        name = getattr(func, "__name__", "")
        for i, a in enumerate(list(args) + list(kwargs.values())):
            for t in (a if isinstance(a, (list, tuple)) else (a,)):
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() in self._regions:
                    tensors.append(t)
                    if i == 0 and (name.endswith("_") or name == "__setitem__"):
                        writes.add(id(t))
        if isinstance(kwargs.get("out"), torch.Tensor):
            writes.add(id(kwargs["out"]))
        if not tensors:
            return
        kinds = {self._regions[t.untyped_storage().data_ptr()].kind for t in tensors}
        # the CPU touching only pinned memory, outside any stream, is the host thread itself
        owner = self.host if kinds == {"host"} and self._current is self.compute else self._current
        where = _where()
        for t in tensors:
            self._access(owner, t, id(t) in writes, where)

    @contextlib.contextmanager
    def watching(self):
        """Check every torch call in this block against the streams' order."""
        fake = self

        class Mode(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                fake._on_torch_call(func, args, kwargs)
                return func(*args, **kwargs)

        with Mode():
            yield self
