"""Several sequences decoded together: each row runs its own engine (its own caches, tiers,
sampler and speculation), and the forward passes the rows ask for at the same time run as one
batched pass, so the weights are read once for the batch.

Each row is a `Lane`: a greenlet (a coroutine on this thread: no concurrency, so the order of
everything is fixed) that runs one task at a time, handed the lane. Every engine is built over
`RowModel`s of its own; a task attaches its engine's to its lane (`with lane.attach(...)`), and
from then on a model call in that engine is the row's suspension point: `RowModel.__call__` hands
the pass to the coordinator (`lane.wait_for_pass`) and waits. Nothing else suspends a row but
`lane.barrier()`. Once every unfinished row waits, the coordinator runs the waiting passes
grouped by (model, logits wanted, and for long passes the number of tokens), each group as one
forward over [rows, T] tokens through a `RowsView` that gives every row's slice of each layer to
that row's own cache view, and resumes each row with its logits. Rows that accept different numbers of drafts, roll
back, or finish stay independent: a row's pass only ever touches its own caches. Short passes of
different lengths (ragged lookup drafts, a draft step beside a verify) run together, padded;
long ones (prefill chunks) only with passes of their own length."""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from greenlet import greenlet

from triforce.errors import UserError

# Passes of at most this many tokens (decoding steps, drafts, verifies) run together whatever
# their lengths, each row padded to the longest: a row's padding is never attended to or
# returned, and every other operator works token by token.
PAD_TO_MERGE = 16


@dataclass
class _Pass:
    model: Any
    tokens: torch.Tensor       # [1, T]
    positions: torch.Tensor    # [1, T]
    view: Any                  # the row's cache view
    num_logits: int | None
    options: dict              # chunk_tokens, group_tokens: such a pass runs alone

    def key(self, row: int) -> tuple:
        alone = row if any(v is not None for v in self.options.values()) else None
        length = self.tokens.shape[1]
        if self.num_logits is None and length <= PAD_TO_MERGE:
            length = 0  # short passes wanting every logit merge, padded to the longest
        return id(self.model), length, self.num_logits, alone


class RowModel:
    """Stands in for `model` inside one engine. Attached to a lane (`Lane.attach`), a call suspends
    that row until the batch's pass has run and returns the row's logits; unattached, it calls the
    model. One per engine (an engine serves one row at a time). Anything else is the model's."""

    def __init__(self, model):
        self._model = model
        self.lane: Lane | None = None

    def __getattr__(self, name: str):
        return getattr(self._model, name)

    def __call__(self, tokens, positions, view, num_logits=None, **options):
        if self.lane is None:
            return self._model(tokens, positions, view, num_logits=num_logits, **options)
        return self.lane.wait_for_pass(_Pass(self._model, tokens, positions, view, num_logits, options))


_BARRIER = object()  # what a row hands the coordinator at Lane.barrier()


class Lane(greenlet):
    """One row of the batch: a greenlet running `task(lane)`, its index among the tasks."""

    def __init__(self, index: int, task: Callable[["Lane"], Any]):
        super().__init__(lambda: task(self))
        self.index = index

    def wait_for_pass(self, request: _Pass) -> torch.Tensor:
        """The suspension point: hand the pass to the coordinator; resumed with this row's logits
        once it has run (or with the error of that pass, raised here)."""
        if greenlet.getcurrent() is not self:
            raise RuntimeError("a RowModel attached to one row was called from another")
        return self.parent.switch(request)

    def barrier(self) -> None:
        """Wait until every row running is at a barrier (or done), e.g. until all have prefilled,
        so that none decodes beside another's prefill."""
        self.parent.switch(_BARRIER)

    @contextmanager
    def attach(self, *models: RowModel) -> Iterator[None]:
        """Route the models' calls through this row for the block's duration."""
        for model in models:
            if model.lane is not None:
                raise RuntimeError("this engine's models already serve another row")
            model.lane = self
        try:
            yield
        finally:
            for model in models:
                model.lane = None


class RowsView:
    """One batched pass's cache view: each row's part of each layer's q, k, v (its first
    `lengths[i]` tokens; the rest is padding) goes to the row's own view."""

    def __init__(self, views: list, lengths: list[int], positions: torch.Tensor):
        self.views, self.lengths, self.positions = views, lengths, positions

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        width = q.shape[2]
        outs = []
        for i, (view, n) in enumerate(zip(self.views, self.lengths)):
            out = view.attend(layer, q[i:i + 1, :, :n], k[i:i + 1, :, :n], v[i:i + 1, :, :n])
            outs.append(out if n == width else torch.nn.functional.pad(out, (0, 0, 0, width - n)))
        return torch.cat(outs)


def _padded(rows: list[torch.Tensor], width: int) -> torch.Tensor:
    """[1, n] rows -> [len(rows), width], each row's last entry repeated."""
    return torch.cat([r if r.shape[1] == width else torch.cat([r, r[:, -1:].expand(1, width - r.shape[1])], 1)
                      for r in rows])


def run_batched(passes: list[_Pass]) -> list[torch.Tensor]:
    """One forward over the passes' rows (same model and logits wanted; short ones padded)."""
    first = passes[0]
    if len(passes) == 1:
        return [first.model(first.tokens, first.positions, first.view, num_logits=first.num_logits,
                            **first.options)]
    lengths = [p.tokens.shape[1] for p in passes]
    width = max(lengths)
    view = RowsView([p.view for p in passes], lengths, _padded([p.positions for p in passes], width))
    logits = first.model(_padded([p.tokens for p in passes], width), view.positions, view,
                         num_logits=first.num_logits)
    return [logits[i:i + 1, :n] for i, n in enumerate(lengths)]


class Lockstep:
    """Runs tasks as rows in lockstep. `run(tasks)` returns each task's result in order.

    `width`: at most this many rows at once; a task starts when a row finishes (its slot frees).
    A task that raises stops the batch: the other rows are unwound and the error is raised.
    After `interrupt()` (or a KeyboardInterrupt during a pass) every waiting row gets a
    KeyboardInterrupt instead of its logits (an engine keeps what it had committed and reports
    "interrupt"), no further task starts, and a task that lets it through has result None."""

    def __init__(self, width: int):
        if width < 1:
            raise UserError(f"the batch size must be >= 1, got {width}")
        self.width = width
        self.interrupted = False
        self.passes = 0          # batched forwards run
        self.rows_per_pass = 0   # summed over them

    def interrupt(self) -> None:
        self.interrupted = True

    def run(self, tasks: list[Callable[[Lane], Any]]) -> list[Any]:
        """Each task is called with its lane."""
        results: list[Any] = [None] * len(tasks)
        queue = [lambda lane, i=i, task=task: results.__setitem__(i, task(lane))
                 for i, task in enumerate(tasks)][::-1]
        self.serve(lambda block: queue.pop() if queue else None)
        return results

    def serve(self, take: Callable[[bool], Callable[[Lane], Any] | None]) -> None:
        """Run tasks as they come: `take(block)` gives the next task (called with its lane) or None. While rows run it
        is asked with block False whenever a slot is free (None: nothing waiting now); with none
        running, with block True (None: no task will come, so return)."""
        waiting: dict[int, tuple[Lane, _Pass]] = {}
        live: list[Lane] = []
        started = 0

        def resume(row: Lane, value=None, error: BaseException | None = None) -> None:
            try:
                if error is not None:
                    out = row.throw(error)
                else:
                    out = row.switch(value) if row else row.switch()  # a new row starts its task
            except KeyboardInterrupt:
                self.interrupted = True
                live.remove(row)
                return
            except BaseException:
                live.remove(row)
                self._unwind(live)
                raise
            if not row.dead:
                waiting[row.index] = (row, out)
                return
            live.remove(row)
            fill(False)

        def fill(block: bool) -> None:
            nonlocal started
            while len(live) < self.width and not self.interrupted:
                task = take(block and not live)
                if task is None:
                    return
                row = Lane(started, task)
                started += 1
                live.append(row)
                resume(row)

        while True:
            fill(True)  # tasks that came while the rows ran join them; with none running, wait
            if not waiting:
                return
            if all(request is _BARRIER for _, request in waiting.values()):
                for index in sorted(waiting):
                    resume(waiting.pop(index)[0])
                continue
            groups: dict[tuple, list[int]] = {}
            for index in sorted(waiting):
                if waiting[index][1] is not _BARRIER:
                    groups.setdefault(waiting[index][1].key(index), []).append(index)
            for members in groups.values():
                rows = [waiting.pop(i) for i in members]
                outs, error = self._pass([p for _, p in rows])
                for i, (row, _) in enumerate(rows):
                    resume(row, None if outs is None else outs[i], error)

    def _pass(self, passes: list[_Pass]) -> tuple[list[torch.Tensor] | None, BaseException | None]:
        """Run one group's pass; on failure every row of it gets the error (its caches roll back)."""
        if self.interrupted:
            return None, KeyboardInterrupt()
        try:
            outs = run_batched(passes)
        except KeyboardInterrupt as e:
            self.interrupted = True
            return None, e
        except BaseException as e:  # noqa: BLE001 - handed to the rows, which re-raise it
            return None, e
        self.passes += 1
        self.rows_per_pass += len(passes)
        return outs, None

    @staticmethod
    def _unwind(live: list[Lane]) -> None:
        """End the other rows (their engines' cleanup runs) after one failed."""
        for row in list(live):
            try:
                row.throw()  # GreenletExit
            except BaseException:  # noqa: BLE001 - the first error is the one to report
                pass
        live.clear()
