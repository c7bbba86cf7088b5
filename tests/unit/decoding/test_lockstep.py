"""The lockstep coordinator (triforce.decoding.lockstep) with a stand-in model: which passes run
together, in what order, and what a failing or interrupted row does to the others."""
import pytest
import torch

from triforce.decoding.lockstep import Lockstep, RowModel
from triforce.errors import UserError


class Recorder:
    """A 'model' whose logits say which row and tokens they came from, and which logs each call."""

    def __init__(self, fail_on: int | None = None, interrupt_on: int | None = None):
        self.calls: list[tuple[int, int]] = []  # (rows, tokens)
        self.fail_on, self.interrupt_on = fail_on, interrupt_on

    def __call__(self, tokens, positions, view, num_logits=None, **options):
        self.calls.append(tuple(tokens.shape))
        if self.fail_on is not None and self.fail_on in tokens[:, 0].tolist():
            raise RuntimeError("the pass failed")
        if self.interrupt_on is not None and self.interrupt_on in tokens[:, 0].tolist():
            raise KeyboardInterrupt
        q = tokens[:, None, :, None].float()
        out = view.attend(0, q, q, q)
        return out[:, 0, :, 0] + positions  # [rows, T]: each row's own tokens and positions


class EchoView:
    """A row's cache view: positions of its own, and attend returns the row's query (so the
    logits prove each row got its own slice)."""

    def __init__(self, start: int, count: int):
        self.positions = torch.arange(start, start + count)[None]
        self.seen = []

    def attend(self, layer, q, k, v):
        self.seen.append(q.shape[0])
        return q


def on_lane(real, body):
    """A task: body(model) with a RowModel of its own, attached to the task's lane."""
    def task(lane):
        model = RowModel(real)
        with lane.attach(model):
            return body(model)
    return task


def call(model, first_token: int, count: int, start: int = 0, **options):
    tokens = torch.arange(first_token, first_token + count)[None]
    view = EchoView(start, count)
    out = model(tokens, view.positions, view, **options)
    assert all(rows == 1 for rows in view.seen)  # the row's view only ever sees that row
    return out


def test_rows_waiting_together_share_one_pass_and_get_their_own_logits():
    real = Recorder()
    lockstep = Lockstep(width=3)
    results = lockstep.run([on_lane(real, lambda model, r=r: [call(model, 100 * r + step, 2, start=10 * r).tolist()
                                                              for step in range(3)]) for r in range(3)])
    assert real.calls == [(3, 2)] * 3  # three steps, all three rows in each
    for r, steps in enumerate(results):
        assert steps == [[[100 * r + step + 10 * r, 100 * r + step + 1 + 10 * r + 1]] for step in range(3)]
    assert lockstep.passes == 3 and lockstep.rows_per_pass == 9


def test_different_token_counts_and_long_passes_run_apart():
    real = Recorder()
    Lockstep(width=5).run([on_lane(real, lambda m: call(m, 0, 1)), on_lane(real, lambda m: call(m, 5, 2)),
                           on_lane(real, lambda m: call(m, 7, 1)),
                           on_lane(real, lambda m: call(m, 9, 1, chunk_tokens=512)),
                           on_lane(real, lambda m: call(m, 11, 1, chunk_tokens=512))])
    assert sorted(real.calls) == [(1, 1), (1, 1), (3, 2)]  # the plain passes joined, padded to 2 tokens


def test_a_finished_row_frees_its_slot_for_the_next_task():
    real = Recorder()
    started = []

    def task(r: int, steps: int):
        def body(model):
            started.append(r)
            for step in range(steps):
                call(model, r, 1)
            return r
        return on_lane(real, body)

    # two slots: task 0 takes one step, so task 2 starts while task 1 is still running
    assert Lockstep(width=2).run([task(0, 1), task(1, 3), task(2, 1)]) == [0, 1, 2]
    assert started == [0, 1, 2]
    assert real.calls == [(2, 1), (2, 1), (1, 1)]


def test_a_failing_pass_reaches_its_rows_and_stops_the_batch():
    real = Recorder(fail_on=7)
    unwound = []

    def task(token: int):
        def body(model):
            try:
                call(model, 0, 1)
                call(model, token, 1)
                call(model, 0, 1)
            finally:
                unwound.append(token)
        return on_lane(real, body)

    with pytest.raises(RuntimeError, match="the pass failed"):
        Lockstep(width=3).run([task(1), task(7), task(2)])
    assert sorted(unwound) == [1, 2, 7]  # every row's cleanup ran


def test_an_interrupt_reaches_every_waiting_row_and_starts_nothing_new():
    real = Recorder(interrupt_on=5)
    seen = []

    def task(token: int):
        def body(model):
            try:
                call(model, token, 1)
                call(model, token, 1)
            except KeyboardInterrupt:
                seen.append(token)
                return "interrupt"
            return "length"
        return on_lane(real, body)

    results = Lockstep(width=2).run([task(5), task(1), task(2)])
    assert results == ["interrupt", "interrupt", None]  # the third never started
    assert sorted(seen) == [1, 5]


def test_an_unattached_row_model_runs_the_model_directly_even_inside_a_row():
    real = Recorder()
    assert call(RowModel(real), 3, 2).tolist() == [[3, 5]]
    assert Lockstep(width=2).run([lambda lane: call(RowModel(real), 1, 1).tolist()]) == [[[1]]]
    assert real.calls == [(1, 2), (1, 1)]
    with pytest.raises(UserError, match="batch size"):
        Lockstep(width=0)


def test_a_model_serves_one_row_at_a_time():
    real = Recorder()
    shared = RowModel(real)

    def first(lane):
        with lane.attach(shared):
            call(shared, 1, 1)
            lane.barrier()

    def second(lane):
        with pytest.raises(RuntimeError, match="another row"):
            with lane.attach(shared):
                pass
        with pytest.raises(RuntimeError, match="called from another"):
            call(shared, 2, 1)  # attached to the first row, called in the second
    Lockstep(width=2).run([first, second])
    assert shared.lane is None  # detached once its task left the block


def test_a_barrier_holds_rows_until_every_row_reaches_it():
    real = Recorder()
    order = []

    def task(r: int, prefill_steps: int):
        def run(lane):
            model = RowModel(real)
            with lane.attach(model):
                for _ in range(prefill_steps):
                    call(model, 1, 4)  # a 'prefill' of its own length
                lane.barrier()
                order.append(r)
                call(model, 1, 1)
            return r
        return run

    assert Lockstep(width=3).run([task(0, 1), task(1, 3), task(2, 2)]) == [0, 1, 2]
    assert real.calls[-1] == (3, 1)  # the decoding steps of all three rows ran as one pass
    assert order == [0, 1, 2] and real.calls.count((3, 1)) == 1


def test_serve_starts_tasks_that_arrive_while_rows_run_and_waits_when_idle():
    """The server's loop: take(False) while rows run (None: nothing new), take(True) when idle
    (None: stop). A task that arrives mid-run joins the running rows' passes."""
    real = Recorder()
    done, started, asked = [], [], []
    tasks = {"a": on_lane(real, lambda m: done.append(("a", [call(m, 1, 1).tolist() for _ in range(4)]))),
             "b": on_lane(real, lambda m: done.append(("b", [call(m, 50, 1).tolist() for _ in range(2)]))),
             "c": on_lane(real, lambda m: done.append(("c", call(m, 70, 1).tolist())))}

    def take(block):
        asked.append(block)
        name = ("a" if not started else "b" if len(started) == 1 and real.calls else
                "c" if len(started) == 2 and block else None)
        if name is None:
            return None
        started.append(name)
        return tasks[name]

    Lockstep(width=2).serve(take)
    assert [name for name, _ in done] == ["b", "a", "c"]
    assert real.calls == [(1, 1), (2, 1), (2, 1), (1, 1), (1, 1)]  # b joined a after a's first step
    assert asked.count(True) == 3  # a and c were taken while idle, and the last None ended it
