"""Counting host synchronizations in the decode loop (a debug aid, `--count-syncs`).

On CUDA, torch's sync debug mode warns at every operation that makes the host wait for the
device (.item(), .tolist(), a blocking copy to the host, ...). The counter records those warnings
and gives each to the innermost phase the engine was in when it happened ("retrieval forward",
"full verify", ...). Decisions need some of them (which drafts were accepted); the rest are
what the fast path should not have."""
from __future__ import annotations

import warnings
from collections import Counter
from contextlib import contextmanager

import torch

SYNC_WARNING = "called a synchronizing CUDA operation"
OUTSIDE = "other"


class SyncCounter:
    def __init__(self):
        self.counts: Counter = Counter()
        self.available = False  # whether the last recording could count (CUDA only)
        self._records: list | None = None
        self._cursor = 0
        self._stack: list[str] = []

    @contextmanager
    def recording(self, device: torch.device):
        """Count while the block runs; on a non-CUDA device nothing can be counted."""
        self.counts.clear()
        self.available = torch.device(device).type == "cuda"
        if not self.available:
            yield self
            return
        previous = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as records:
                warnings.simplefilter("always")
                with self.capturing(records):
                    yield self
        finally:
            torch.cuda.set_sync_debug_mode(previous)

    @contextmanager
    def capturing(self, records: list):
        """Attribute the warnings appended to `records` while the block runs (the CUDA part of
        `recording`; tests feed it directly)."""
        self._records, self._cursor, self._stack = records, len(records), []
        try:
            yield self
        finally:
            self._settle(OUTSIDE)
            self._records = None

    @contextmanager
    def phase(self, name: str):
        if self._records is None:
            yield
            return
        self._settle(self._stack[-1] if self._stack else OUTSIDE)
        self._stack.append(name)
        try:
            yield
        finally:
            self._settle(self._stack.pop())

    def _settle(self, name: str) -> None:
        new = self._records[self._cursor:]
        self._cursor = len(self._records)
        found = sum(1 for w in new if SYNC_WARNING in str(w.message))
        if found:
            self.counts[name] += found

    def report(self, tokens: int) -> dict | str:
        if not self.available:
            return "counted on CUDA only"
        total = sum(self.counts.values())
        return {"total": total, "per_token": round(total / tokens, 3) if tokens else None,
                "by_phase": dict(self.counts.most_common())}
