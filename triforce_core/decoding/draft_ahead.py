"""Drafting the next cycle while the full tier verifies this one.

On an offloaded cache the full verify waits on host KV streaming over PCIe while the GPU's cores
idle. The tier below the full one uses that time: it goes on proposing past the drafts under
verification, as if the verify accepted them all; the first token it proposes is its guess at the
verify's bonus token. The tokens after the guess become the next cycle's drafts when the verify
accepts every draft and its bonus token equals the guess, so they continue the sequence the
next verify reads; otherwise they are dropped (they would continue a different one and be
rejected). The guess is right about as often as the tier below agrees with the full one, which
for the retrieval tier (the target itself over a selected cache) is most rounds.

Why it stays exact: speculative sampling asks of a proposal only that it was drawn from the
distribution the verify is given and independently of the verify's own draws. Each kept token
carries the distribution it was drawn from, and whether it is kept depends on the guess and the
bonus token, never on it; the next verify draws afresh.

Two schedules run the same decisions: inline (the verify, then the drafting, in program order:
a CPU, where nothing would run beside it, and tests) and threaded (CUDA: the verify on a worker
thread on the default stream, the drafting on the calling thread on a stream of its own)."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, TypeVar

import numba
import torch

from triforce.decoding.observers import Observer
from triforce.offload.streams import SyncStreams, streams_for

T = TypeVar("T")
U = TypeVar("U")

@dataclass
class Ahead:
    """Tokens the tier below the full one proposed past a verify's drafts, with the distribution
    each was drawn from (None: greedy or deterministic) and the passes that made them."""
    tokens: list[int]
    dists: list
    passes: list = field(default_factory=list)

    def follow_on(self, accepted_all: bool, bonus: int) -> "Ahead | None":
        """The next cycle's drafts: the tokens after the guess, if the verify accepted every draft
        and its bonus token is the guess; else None."""
        if not (accepted_all and self.tokens and self.tokens[0] == bonus):
            return None
        return Ahead(self.tokens[1:], self.dists[1:], self.passes)


@dataclass
class AheadTally(Observer):
    rounds: int = 0  # verifies drafted ahead of
    kept: int = 0    # ... whose drafts the next cycle took

    def started(self, params) -> None:
        self.rounds = self.kept = 0

    def report(self) -> dict:
        return {"draft_ahead_rounds": self.rounds, "draft_ahead_kept": self.kept}


def wanted(asked: bool, levels: list, tensor_parallel: bool, counting_syncs: bool) -> bool:
    """Whether an engine asked to draft ahead can: something drafts for the full tier, and neither
    tensor parallelism (both threads would issue collectives) nor a host-sync count (one thread's).
    Off unless asked: on a CPU it costs every dropped cycle's drafting (bench/RESULTS.md), and on
    a GPU no run has measured it yet (bench offload's triforce-ahead row will)."""
    return asked and len(levels) >= 2 and not tensor_parallel and not counting_syncs


class AheadRunner:
    """Runs a verify and the drafting ahead of it: side by side on a device with streams, one after
    the other elsewhere. It speaks triforce.offload.streams' interface, as the prefetcher does, so
    tests run the CUDA schedule under the checked fake (tests/cuda_semantics)."""

    def __init__(self, device: torch.device, threaded: bool | None = None, streams: SyncStreams | None = None):
        """threaded: the verify on a worker thread (default: where the device has streams; tests also
        run it so on a CPU)."""
        self.streams = streams if streams is not None else streams_for(device)
        self.threaded = self.streams.asynchronous if threaded is None else threaded
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="full-verify") if self.threaded else None
        self._stream = self.streams.stream("drafting") if self.threaded and self.streams.asynchronous else None

    def run(self, verify: Callable[[], T], draft: Callable[[], U]) -> tuple[T, U]:
        if not self.threaded:
            return verify(), draft()
        streams, mine = self.streams, self._stream
        main = streams.current()
        if mine is not None:
            streams.wait_stream(mine, main)  # before the verify's kernels queue up: the drafts read the last commit
        future = self._pool.submit(self._in_worker, streams.worker(), numba.get_num_threads(), verify)
        try:
            with streams.on(mine):
                drafted = draft()
            if mine is not None:
                streams.wait_stream(main, mine)  # the drafts' tensors are read on the default stream next
        finally:
            result = future.result()  # even when drafting failed: nothing may touch the cache mid-verify
        return result, drafted

    @staticmethod
    def _in_worker(context, threads: int, fn: Callable[[], T]) -> T:
        numba.set_num_threads(threads)  # per thread, as CUDA's current device: the caller's --threads
        with context:  # the worker's device (CUDA's current device is per thread)
            return fn()
