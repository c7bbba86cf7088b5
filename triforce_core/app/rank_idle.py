"""Rank 0's announcements to the other tensor-parallel ranks (the next chat line, the next server
request), and heartbeats while it waits for them: a follower waits for the next one inside a
collective, which gives up after the process group's timeout (triforce.app.ranks), so an hour
without a request would end it. While rank 0 is idle a thread announces a heartbeat every quarter
of that timeout; followers skip heartbeats. A lock keeps the heartbeats and the announcements in one
order on every rank, and no heartbeat goes out while rank 0 decodes (its passes' collectives)."""
from __future__ import annotations

import threading
from contextlib import contextmanager

import torch
import torch.distributed as dist

HEARTBEAT = ("triforce-heartbeat",)


def _broadcast(item) -> object:
    box = [item]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def receive() -> object:
    """A follower: rank 0's next announcement, heartbeats skipped."""
    while (item := _broadcast(None)) == HEARTBEAT:
        pass
    return item


class Announcer:
    """Rank 0's side: `announce(item)` to every rank; `with idle():` around a wait for the next
    item sends heartbeats until it ends."""

    def __init__(self):
        from triforce.app.ranks import collective_timeout_s

        self.interval_s = collective_timeout_s() / 4
        self._lock = threading.Lock()
        self._idle = False
        self._stopped = threading.Event()
        self._device = torch.cuda.current_device() if dist.get_backend() == "nccl" else None
        self._thread: threading.Thread | None = None

    def announce(self, item) -> None:
        with self._lock:
            _broadcast(item)

    @contextmanager
    def idle(self):
        with self._lock:
            self._idle = True
        if self._thread is None:
            self._thread = threading.Thread(target=self._beat, daemon=True, name="tp-heartbeat")
            self._thread.start()
        try:
            yield
        finally:
            with self._lock:
                self._idle = False

    def stop(self) -> None:
        """No heartbeat after this (before the last announcement, or the ranks' teardown)."""
        self._stopped.set()
        with self._lock:
            self._idle = False

    def _beat(self) -> None:
        if self._device is not None:  # NCCL: this thread's collectives on rank 0's card
            torch.cuda.set_device(self._device)
        while not self._stopped.wait(self.interval_s):
            with self._lock:
                if self._idle and not self._stopped.is_set():
                    try:
                        _broadcast(HEARTBEAT)
                    except RuntimeError:  # a rank is gone: the next announcement reports it
                        self._stopped.set()
