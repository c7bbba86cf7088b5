"""The runner of the drafting tiers' forward passes: eager through the cache's own step view, or
through a fixed-shape view that a CUDA graph can capture. CUDA graphs live here and nowhere else.

The fixed-shape view writes the new tokens' KV at slots held in a device tensor and attends over
the cache's whole buffer with a mask (slot j is visible to new token i iff j <= slot_i), so one
graph per number of new tokens serves every step: static input buffers (tokens, positions,
slots), one memory pool shared by the runner's graphs, and eager execution whenever a
step has more tokens than graphs are kept for or capture fails.

Modes: "eager" (the cache's step view), "static" (the fixed-shape view without capture: the
reference the graphs replay, runnable on CPU), "graph" (captured on first use, then replayed)."""
from __future__ import annotations

import contextlib
import sys
from typing import Callable

import torch

from triforce.errors import UserError
from triforce.config import MAX_GRAPH_TOKENS
from triforce.kernels.device_kind import on_cuda

MODES = ("eager", "static", "graph")


def runner_mode(graphs: str, device: torch.device) -> str:
    """An engine's `graphs` setting (auto | off | static) -> the drafting tiers' runner mode."""
    if graphs not in ("auto", "off", "static"):
        raise UserError(f"unknown graphs setting '{graphs}' (choose auto, off or static)")
    if graphs == "auto":
        return "graph" if torch.device(device).type == "cuda" else "eager"
    return "eager" if graphs == "off" else "static"


def host_ids(rows: list[list[int]], device: torch.device) -> torch.Tensor:
    """int64 rows on the host, pinned when they are bound for a CUDA device, so a non_blocking
    copy is truly asynchronous (PyTorch keeps the pinned block until the copy has run)."""
    return torch.tensor(rows, dtype=torch.long, device="cpu", pin_memory=torch.device(device).type == "cuda")


def device_tokens(ids: list[int], device: torch.device) -> torch.Tensor:
    """[1, T] int64 on `device` without waiting for the device: the copy is queued on the stream
    (torch's blocking host-to-device copy would synchronise the stream first)."""
    return host_ids([ids], device).to(device, non_blocking=True)


@contextlib.contextmanager
def captures_held(levels):
    """No tier captures a graph inside the block (steps without one run uncaptured)."""
    runners = [t.runner for t in levels if getattr(t, "runner", None) is not None]
    for runner in runners:
        runner.captures_held = True
    try:
        yield
    finally:
        for runner in runners:
            runner.captures_held = False


class StaticStepView:
    """A cache view of fixed shape over `k_buf`, `v_buf` [L, B, Hkv, capacity, D] for `num_new`
    tokens; tokens, positions and slots are device tensors the runner fills before each run.
    record: each layer's queries are kept in `queries` (a graph's replay rewrites them in place)."""

    def __init__(self, k_buf: torch.Tensor, v_buf: torch.Tensor, scale: float, attn, num_new: int,
                 record: bool = False):
        self.k_buf, self.v_buf, self.scale, self.attn = k_buf, v_buf, scale, attn
        self.queries: list[torch.Tensor | None] | None = [None] * k_buf.shape[0] if record else None
        device = k_buf.device
        self.tokens = torch.zeros(1, num_new, dtype=torch.long, device=device)
        self.positions = torch.zeros(1, num_new, dtype=torch.long, device=device)
        self.slots = torch.zeros(num_new, dtype=torch.long, device=device)
        self.cache_seqlens = torch.zeros(k_buf.shape[1], dtype=torch.int32, device=device)  # [B]: slots[0]
        self._key_index = torch.arange(k_buf.shape[3], device=device)
        self._visible: torch.Tensor | None = None

    def begin(self) -> None:
        """Derive this run's mask and lengths from the slots (inside the graph when captured)."""
        self._visible = self._key_index[None, :] <= self.slots[:, None]  # [T, capacity]
        self.cache_seqlens.copy_(self.slots[:1].to(torch.int32).expand_as(self.cache_seqlens))

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.queries is not None:
            self.queries[layer] = q
        return self.attn.attend_fixed(q, self.k_buf[layer], self.v_buf[layer], k, v, slots=self.slots,
                                      cache_seqlens=self.cache_seqlens, visible=self._visible, scale=self.scale)


class TierRunner:
    """Runs `model` over a cache with k_buf, v_buf, scale, attn, `end` (its next free slot) and a
    step whose new tokens take physical slots [start, end): a sparse or streaming cache, or the
    full tier's resident one. A run that records queries (the full tier's verify, for retrieval)
    has graphs of its own."""

    def __init__(self, model, cache, mode: str = "eager", max_graph_tokens: int = MAX_GRAPH_TOKENS,
                 agree: Callable[[bool], bool] | None = None):
        if mode not in MODES:
            raise ValueError(f"unknown runner mode '{mode}' (choose from {', '.join(MODES)})")
        if mode == "graph" and not on_cuda(cache.k_buf):
            raise ValueError("CUDA graphs need a CUDA device")
        self.model, self.cache, self.mode = model, cache, mode
        self.max_graph_tokens = max_graph_tokens
        # by (tokens, record)
        self._views: dict[tuple[int, bool], StaticStepView] = {}
        self._graphs: dict[tuple[int, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.queries: list[torch.Tensor] | None = None  # the last recording run's, per layer [B, H, T, D]
        # One memory pool for this runner's graphs, made at the first capture and gone with them.
        # Not one per process: once every graph of a pool is freed (an engine ends), PyTorch
        # cannot capture into that pool again (an internal assert, seen on an H100 with torch 2.11).
        self._pool = None
        self._side = None  # the one stream this runner captures on: each stream holds a cuBLAS workspace
        self.graph_failed: str | None = None  # why capture was given up (then everything runs eagerly)
        # agree(ok) -> whether every rank captured: under tensor parallelism all ranks must take the
        # same path (a graph on one rank and eager code on another put collectives out of step)
        self.agree: Callable[[bool], bool] = agree or (lambda ok: ok)
        self.replays = 0      # graph replays
        self.static_runs = 0  # fixed-shape runs without a graph (static mode, captures)
        self.eager_runs = 0
        # while held (another thread is issuing work: a verify beside drafting ahead), a step
        # without a graph runs uncaptured: a capture there would make that thread's allocations
        # and syncs illegal, and it would wait for the other thread's queued work
        self.captures_held = False

    def report(self) -> dict:
        return {"mode": self.mode, "replays": self.replays, "static_runs": self.static_runs,
                "eager_runs": self.eager_runs, "graph_failed": self.graph_failed}

    def run(self, tokens: list[int], step, record: bool = False) -> torch.Tensor:
        """Logits [T, V] of `tokens` fed through `step` (from cache.step(T, record)); with record,
        each layer's queries in self.queries."""
        num_new = len(tokens)
        self.queries = None
        if self.mode == "eager" or num_new > self.max_graph_tokens or self.graph_failed:
            self.eager_runs += 1
            logits = self.model(device_tokens(tokens, self.cache.k_buf.device), step.positions, step)[0]
            self.queries = step.queries if record else None
            return logits
        key = (num_new, record)
        view = self._view(key)
        inputs = host_ids([tokens, list(range(step.start, step.end))], view.tokens.device)
        view.tokens[0].copy_(inputs[0], non_blocking=True)
        view.slots.copy_(inputs[1], non_blocking=True)
        view.positions.copy_(step.positions)
        if self.mode == "static" or key not in self._graphs and self.captures_held:
            self.static_runs += 1
            out = self._forward(view)
        elif key in self._graphs:
            out = self._graphs[key][1]
            self._graphs[key][0].replay()
            self.replays += 1
        elif not self._capture_agreed(key, view):
            out = self._forward(view)
        else:
            out = self._graphs[key][1]
        if record:
            self.queries = [q.clone() for q in view.queries]
        return out[0].clone()  # the next replay overwrites `out`

    def prepare(self, lengths, record: bool = False) -> None:
        """Capture the graphs of these step lengths now, before decoding, so no capture stalls a
        decoding step. Capture writes placeholder KV at the slots after the cache's end, which
        every real step overwrites before it reads them (each query sees only slots up to its own)."""
        if self.mode != "graph" or self.graph_failed:
            return
        start = self.cache.end
        for num_new in lengths:
            key = (num_new, record)
            if key in self._graphs or num_new > self.max_graph_tokens or start + num_new > self.cache.k_buf.shape[3]:
                continue
            view = self._view(key)
            view.tokens.zero_()
            view.slots.copy_(torch.arange(start, start + num_new, device=view.slots.device))
            view.positions.copy_(view.slots[None])
            if not self._capture_agreed(key, view):
                return

    def _capture_agreed(self, key: tuple[int, bool], view: StaticStepView) -> bool:
        """Capture the graph for key = (tokens, record) (running this step once); False, and eager
        from now on, when this rank or any other could not."""
        self.static_runs += 1
        captured, failure = None, None
        try:
            captured = self._capture(view)
        except RuntimeError as e:  # an op that cannot be captured: stay eager from now on
            failure = str(e).splitlines()[0] if str(e) else type(e).__name__
        if not self.agree(captured is not None):
            self.graph_failed = failure or "another rank could not capture"
            print(f"note: CUDA graph capture failed, running eagerly ({self.graph_failed})", file=sys.stderr)
            self._graphs.clear()
            return False
        self._graphs[key] = captured
        return True

    def _view(self, key: tuple[int, bool]) -> StaticStepView:
        if key not in self._views:
            c = self.cache
            self._views[key] = StaticStepView(c.k_buf, c.v_buf, c.scale, c.attn, *key)
        return self._views[key]

    def _forward(self, view: StaticStepView) -> torch.Tensor:
        view.begin()
        return self.model(view.tokens, view.positions, view)

    def _capture(self, view: StaticStepView):
        """Warm up on the runner's side stream, then capture. The inputs are this step's real ones and every
        write is idempotent (the same KV to the same slots), so warm-up runs change nothing.
        capture_begin/end rather than torch.cuda.graph, whose entry synchronises the device and
        empties the allocator's and the pinned host caches; thread_local: another thread's work
        (a prefetch, a verify) stays legal while this one captures."""
        if self._side is None:
            self._side = torch.cuda.Stream()
        side = self._side
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self._forward(view)
            graph = torch.cuda.CUDAGraph()
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
            try:
                out = self._forward(view)
            except BaseException:
                with contextlib.suppress(RuntimeError):  # the capture is void: say why it failed
                    graph.capture_end()
                raise
            graph.capture_end()
        torch.cuda.current_stream().wait_stream(side)
        graph.replay()  # capture records without running: run it once for this step
        return graph, out
