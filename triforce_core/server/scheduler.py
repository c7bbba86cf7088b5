"""The server's decoding thread: each request is a row of one lockstep batch
(triforce.decoding.lockstep), so requests that run at the same time share every forward pass.

Rows decode on one thread of their own, in token ids only; the event loop renders and
tokenizes the request before and detokenizes after. A row's engine stays with its cache when
the request ends, so a later request that extends the same conversation (the next turn of a chat
over a long document) takes the engine whose cache holds the longest prefix of it and prefills
only the rest. At most `width` rows run (the plan's batch size); later requests wait in a queue
of at most `queue_size`. A request that starts with no other row running or waiting decodes as
`generate` would, over the same cache, where that fits (batch_generate.lone_row_plan): a batch's
plan must not slow a lone conversation."""
from __future__ import annotations

import queue
import sys
import threading
import time
from collections import deque
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable

from greenlet import GreenletExit

from triforce.app.batch_generate import lone_row_plan, row_models
from triforce.decoding.lockstep import Lockstep
from triforce.decoding.logprobs import LogprobRecorder
from triforce.decoding.numerics import SYMPTOMS, located

# An idle decoding loop's longest wait: a process's signal may land on any of its threads, and
# Python runs the handler on the main thread only when that thread next runs (Ctrl-C on a card).
WAKE_S = 0.2


class QueueFull(Exception):
    """Every row is busy and the queue holds queue_size requests already."""


class Cancelled(Exception):
    """The client went away (or the answer hit a stop string) during the prefill."""


@dataclass
class Job:
    """One request's decoding. `emit(event)` is called on the decoding thread with
    ("prefill", reused_tokens, prompt_tokens), ("progress", tokens_prefilled),
    ("token", id, logprob), ("done", stopped_by) or ("error", message); logprob is a
    decoding.logprobs.TokenLogprob where `logprobs` (the alternatives wanted) is set, else None.
    Setting `stop` (from any thread) ends the request at the next round: the client went away or
    a stop string matched."""
    ids: list[int]
    max_new: int
    params: Any  # SamplingParams
    emit: Callable[[tuple], None]
    label: str = ""
    ignore_eos: bool = False
    logprobs: int | None = None
    stop: bool = False
    tokens: int = 0
    submitted: float = field(default_factory=time.perf_counter)


@dataclass(eq=False)
class _Slot:
    engine: Any = None
    models: Any = None  # the RowModels the engine was built over (triforce.app.batch_generate)
    lone: Any = None    # an engine over engine's full tier for a row alone (Scheduler.lone_run; one slot at most)
    job: Job | None = None
    used: int = 0  # when it last served a request (a counter): ties go to the least recently used

    def stop_requested(self) -> bool:
        return self.job is not None and self.job.stop


class Scheduler:
    def __init__(self, runtime, run, max_len: int, width: int, queue_size: int, log: bool = True):
        """Under tensor parallelism (runtime.world > 1) width must be 1: requests run one at a time,
        each announced to the other ranks, which decode it beside this one (triforce.server.tp)."""
        if runtime.world > 1 and width != 1:
            raise ValueError("tensor-parallel serving decodes one request at a time")
        self.runtime, self.run, self.max_len = runtime, run, max_len
        self.width, self.queue_size, self.log = width, queue_size, log
        self.stop_ids = runtime.lm.eos_ids
        self.slots: list[_Slot] = []
        self._incoming: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self.queued = 0     # submitted, not yet started
        self.running = 0    # rows decoding now
        self.served = 0     # requests finished (any way)
        self.decoded_alone = 0  # requests started on a slot's lone engine
        self.failure: str | None = None  # the decoding thread died of this
        self._closing = False
        self._clock = 0
        self.lockstep = Lockstep(width)
        self.lone_run = lone_row_plan(runtime, run, max_len, width) if width > 1 else None
        self.recent: deque = deque(maxlen=64)  # (label, prompt tokens, reused, new tokens, stopped_by)
        self._thread = threading.Thread(target=self._loop, name="triforce-decode", daemon=True)
        self._here = False  # serve_here: rows decode on the thread that called it
        self._ended = threading.Event()

    # ---- the server's side -------------------------------------------------------------------
    def start(self) -> None:
        """Start decoding (the API's lifespan calls this): on a thread of its own, unless serve_here runs."""
        if not self._here:
            self._thread.start()

    def serve_here(self, serve_http: Callable[[], None]) -> None:
        """Run serve_http (the HTTP server, whose lifespan calls start and close) on a thread and
        decode on this one until it returns. libgomp lets idle workers spin between a token's
        kernels only under the process's first thread (it throttles the spin once it manages more
        threads than cores): elsewhere a row decoded at half speed (bench/RESULTS.md, the server)."""
        self._here = True

        def http() -> None:
            try:
                serve_http()
            finally:  # a server that stopped, or never started, ends the decoding too
                self.close()

        thread = threading.Thread(target=http, name="triforce-http")
        thread.start()
        self._loop()
        thread.join()

    def submit(self, job: Job) -> None:
        """Queue a request; QueueFull when the queue is full, RuntimeError once closed or failed."""
        with self._lock:
            if self.failure is not None or self._closing:
                raise RuntimeError(self.failure or "the server is shutting down")
            if self.queued >= self.queue_size:
                raise QueueFull
            self.queued += 1
        self._incoming.put(job)

    def close(self) -> None:
        """Finish the rows running, then end the decoding (requests still queued get an error)."""
        with self._lock:
            self._closing = True
        self._incoming.put(None)
        self._ended.wait()  # set as the decoding loop ends, on whichever thread it ran

    def status(self) -> dict:
        steps = self.lockstep
        return {"rows_running": self.running, "queued": self.queued, "batch_size": self.width,
                "engines": len(self.slots), "served": self.served, "decoded_alone": self.decoded_alone,
                "method_alone": self.lone_run.spec.method if self.lone_run else None, "forward_passes": steps.passes,
                "rows_per_pass": round(steps.rows_per_pass / steps.passes, 3) if steps.passes else None}

    # ---- the decoding thread -----------------------------------------------------------------
    def _loop(self) -> None:
        try:
            if self.runtime.world > 1:
                from triforce.server.tp import lead_requests
                lead_requests(self)
            else:
                self.lockstep.serve(self._take)
        except BaseException as e:  # noqa: BLE001 - reported to every client and on /health
            self.failure = f"the decoding thread failed: {type(e).__name__}: {e}"
            print(f"triforce serve: {self.failure}", file=sys.stderr)
        finally:
            self._drain()
            self._ended.set()

    def _take(self, block: bool):
        job = self.next_job(block)
        return None if job is None else lambda lane: self.serve_request(job, lane)

    def next_job(self, block: bool) -> Job | None:
        """The next request (None: none now; with block, none will come)."""
        job = None
        while not (self._closing and self._incoming.empty()):
            try:  # in slices: the main thread runs a handler for a signal another thread took (WAKE_S)
                job = self._incoming.get(block=block, timeout=WAKE_S if block else None)
            except queue.Empty:
                if block:
                    continue
            break
        if job is None:
            return None
        with self._lock:
            self.queued -= 1
        return job

    def _drain(self) -> None:
        while not self._incoming.empty():  # only this thread takes from it
            job = self._incoming.get_nowait()
            if job is not None:
                job.emit(("error", self.failure or "the server is shutting down"))

    def _slot_for(self, ids: list[int]) -> tuple[_Slot, int]:
        """The free engine whose cache holds the longest prefix of ids, when that prefix is most of
        what it holds (the same conversation, grown); else a new engine while there are fewer than
        `width` (another conversation's cache survives); else the least recently used one.
        Returns it and how many leading tokens of ids its cache holds."""
        free = [s for s in self.slots if s.job is None]
        shared = {id(s): s.engine.full.reusable_prefix(ids) for s in free}
        best = max(free, key=lambda s: (shared[id(s)], -s.used), default=None)
        if best is None or 2 * shared[id(best)] < len(best.engine.full.tokens):
            if len(self.slots) < self.width:
                best = _Slot()
                best.models = row_models(self.runtime)
                best.engine = self.build_engine(best.models)
                self.slots.append(best)
                shared[id(best)] = 0
            else:
                best = min(free, key=lambda s: s.used)
        self._clock += 1
        best.used = self._clock
        return best, shared[id(best)]

    def build_engine(self, models):
        """A row's engine over its own RowModels."""
        return self.runtime.engine(self.max_len, self.run, lm=models.lm, draft=models.draft, graphs="off")

    def stop_check(self, slot: _Slot, engine) -> Callable[[], bool]:
        """Whether the slot's request stops, asked before each round: under tensor parallelism every
        rank asks rank 0."""
        if self.runtime.world > 1:
            return lambda: bool(engine.hooks.agree([int(slot.stop_requested())])[0])
        return slot.stop_requested

    def _engine_for(self, slot: _Slot):
        """The slot's batch engine, or its lone one when this request runs alone (a seeded sample
        gives the same text on either: decoding.sampling.PositionNoise)."""
        if self.lone_run is None or self.running > 1 or self.queued:
            return slot.engine
        if slot.lone is None:
            for other in self.slots:  # one lone engine at a time: the room planned holds one's tiers
                other.lone = None
            slot.lone = self.runtime.engine(self.max_len, self.lone_run, lm=slot.models.lm, draft=slot.models.draft,
                                            graphs="off", full=slot.engine.full)
        return slot.lone

    def serve_request(self, job: Job, lane=None) -> None:
        """One request, as a row of the batch (lane: its row; None: decoded alone, under --tp)."""
        slot = None
        self.running += 1
        try:
            if job.stop:  # the client left while it was queued
                raise Cancelled
            slot, shared = self._slot_for(job.ids)
            slot.job = job
            engine = self._engine_for(slot)
            self.decoded_alone += engine is slot.lone
            # what the cache keeps (the last token is fed when decoding starts; a selection's window re-runs)
            reused = len(job.ids) - 1 - engine.tokens_to_prefill(job.ids)
            job.emit(("prefill", reused, len(job.ids)))

            def progress(n: int) -> None:
                job.emit(("progress", n))
                if job.stop and self.runtime.world == 1:  # ranks stop together, between rounds
                    raise Cancelled

            recorder = None if job.logprobs is None else LogprobRecorder(top=job.logprobs)

            def on_token(token: int) -> None:
                job.emit(("token", token, None if recorder is None else recorder.entries[job.tokens]))
                job.tokens += 1

            # in a batch, this engine's passes wait for the batch's (lockstep.RowModel)
            with lane.attach(*slot.models.models()) if lane is not None else nullcontext():
                started = time.perf_counter()
                engine.set_sequence(job.ids, progress)
                prefilled = time.perf_counter()
                try:
                    result = engine.generate(job.max_new, job.params, frozenset() if job.ignore_eos else self.stop_ids,
                                             on_token, logprobs=recorder, stop_requested=self.stop_check(slot, engine))
                except SYMPTOMS as e:  # this request fails with the layer named; the server goes on
                    raise located(e, self.runtime.lm, engine.seq) from None
            # recorded before the client hears "done": /health and tests read it after the reply
            self.recent.append((job.label, len(job.ids), reused, len(result.tokens), result.stopped_by))
            job.emit(("done", result.stopped_by))
            self._say(job, reused, prefilled - started, result, alone=engine is slot.lone)
        except Cancelled:
            self.recent.append((job.label, len(job.ids), 0, 0, "interrupt"))
            job.emit(("done", "interrupt"))
        except GreenletExit:  # the batch is being torn down (the thread failed)
            job.emit(("error", "the server stopped decoding"))
            raise
        except Exception as e:  # noqa: BLE001 - one request's failure, reported to its client
            if slot is not None:  # its caches may be half-updated: never reuse them
                self.slots.remove(slot)
                slot = None
            job.emit(("error", f"{type(e).__name__}: {e}"))
            if self.runtime.world > 1:  # the other ranks may be out of step now: stop serving
                raise
        finally:
            if slot is not None:
                slot.job = None
            self.running -= 1
            self.served += 1

    def _say(self, job: Job, reused: int, prefill_s: float, result, alone: bool) -> None:
        if not self.log:
            return
        n = len(result.tokens)
        rate = f", {n / result.time_s:.1f} tok/s" if result.time_s else ""
        way = f", alone: {self.lone_run.spec.method}" if alone else ""
        print(f"triforce serve: {job.label} {len(job.ids)} prompt tokens ({reused} reused, prefill {prefill_s:.2f} s), "
              f"{n} tokens in {result.time_s:.2f} s{rate}, stopped by {result.stopped_by}{way}", file=sys.stderr)
