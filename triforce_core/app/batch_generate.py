"""Many prompts decoded as one batch (`generate --prompts`): each row has its own engine (caches,
tiers, sampler), the rows' forward passes run together (triforce.decoding.lockstep), and a row
that finishes hands its engine to the next prompt waiting.

The memory plan is made for one row with 1/B of what the device has beside the weights, which
every row shares; so B rows of that plan fit together. The default batch size is the most rows
(up to the number of prompts) whose plan fits."""
from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Callable, Iterator, NamedTuple

from triforce.app.batch_tally import BatchTally
from triforce.app.plan_and_cache import RunPlan
from triforce.config import AUTO
from triforce.decoding.draft import Draft
from triforce.decoding.lockstep import Lockstep, RowModel
from triforce.decoding.statistics import GenerationResult
from triforce.errors import UserError

def row_plan(runtime, max_len: int, rows: int, spec=None, fixed: frozenset | None = None) -> RunPlan:
    """The plan of one row when `rows` rows share the device: the weights once, the rest split.
    --method auto picks the method, budget and gammas for the batch (triforce.plan.batch_choice).
    spec, fixed: instead of the runtime's (a benchmark running several methods)."""
    from triforce.plan.batch_choice import choose_for_batch, predict_batch, row_profile, spec_for

    lm, choice, online = runtime.lm, None, None
    spec = spec or runtime.config.spec
    fixed = runtime.config.fixed if fixed is None else fixed
    if spec.method == AUTO and rows == 1:  # one row alone: what `generate` would run
        return runtime.plan(max_len, spec=spec, fixed=fixed)
    if spec.method == AUTO:
        predictions = predict_batch(lm.config, runtime.profile, max_len, rows, spec, dtype_bytes=lm.dtype.itemsize,
                                    fixed=fixed)
        if not predictions:
            raise UserError(f"no method fits a batch of {rows} rows of {max_len} tokens in profile "
                            f"{runtime.profile.name}")
        choice = choose_for_batch(predictions)
        spec, fixed = spec_for(choice.chosen, spec, fixed)
        # each row then checks its own rounds against ar steps (the single run's online check), so
        # a row the batch's method slows (text it drafts badly, or alone on the server) decodes as ar
        online = row_check(choice, max_len)
    draft = runtime.draft.model if runtime.draft.kind == "model" else None
    profile = row_profile(lm.config, runtime.profile, rows, lm.dtype.itemsize, draft=draft and draft.config,
                          draft_dtype_bytes=draft and draft.dtype.itemsize)
    return replace(runtime.plan(max_len, spec=spec, fixed=fixed, profile=profile), batch=choice, auto=online)


# what a lone row's engine holds beside the full cache its batch engine shares with it
LONE_TIER_PARTS = ("retrieval_cache", "streaming_cache", "chunk_means", "cuda_graph_pool")


def lone_row_plan(runtime, run: RunPlan, max_len: int, rows: int) -> RunPlan | None:
    """How a row of a batch that --method auto planned decodes while it runs alone: as `generate`
    would (the single run's choice and online check) over the row's own full cache (a lone
    conversation on a 4-row server decoded at 0.39x of a 1-row server's speed,
    bench/history/2026-11-28-long-document-server.md). Its tiers (a retrieval cache, a draft's
    streaming cache) come on top of the batch's `rows` rows, one lone engine at a time: None where
    they would not fit, or where the batch's method was named by the user."""
    if run.batch is None or runtime.world > 1:
        return None
    lone = row_plan(runtime, max_len, 1)
    shared = sum(run.plan.breakdown.get(part, 0) for part in ("target_weights", "draft_weights"))
    batch = shared + rows * (run.plan.gpu_bytes_total - shared)
    tiers = sum(lone.plan.breakdown.get(part, 0) for part in LONE_TIER_PARTS)
    return lone if batch + tiers <= runtime.profile.device_budget_bytes else None


def row_check(choice, max_len: int):
    """A row's online check under a batch's --method auto: a MethodChoice that speculates from the
    start (None where the batch chose ar)."""
    from triforce.plan.method_choice import MethodChoice

    if choice.chosen.method == "ar":
        return None
    return MethodChoice(choice.chosen.method, 0, max_len, {p.method: p.ms_per_token for p in choice.predictions})


# the default batch size stops here: past a few dozen rows a step's weights are already shared
# and more rows only hold more memory (a 3,000-prompt file once asked for 2,239 rows, 40 GiB)
MAX_AUTO_ROWS = 32


def fit_batch(runtime, max_len: int, prompts: int, wanted: int | None) -> tuple[int, RunPlan]:
    """The batch size (wanted, or the most rows up to `prompts` and MAX_AUTO_ROWS whose plan fits
    the device and whose buffers the host has room for) and one row's plan."""
    if wanted is not None:
        if wanted < 1:
            raise UserError(f"--batch-size must be >= 1, got {wanted}")
        rows = min(wanted, prompts)
        return rows, _feasible(runtime, max_len, rows)
    best = (1, row_plan(runtime, max_len, 1))  # the error of a single row, if even that cannot fit
    low, high = 2, min(prompts, MAX_AUTO_ROWS)  # a row's share only shrinks as rows are added: bisect
    while low <= high:
        rows = (low + high) // 2
        try:
            plan = row_plan(runtime, max_len, rows)
            runtime.check_host_room(plan, max_len, rows)
            best = (rows, plan)
            low = rows + 1
        except UserError:
            high = rows - 1
    return best


def _feasible(runtime, max_len: int, rows: int) -> RunPlan:
    try:
        return row_plan(runtime, max_len, rows)
    except UserError as e:
        raise UserError(f"a batch of {rows} rows does not fit: {e} (try a smaller --batch-size)") from None


@dataclass
class BatchRow:
    index: int
    prompt_tokens: int
    result: GenerationResult | None  # None: interrupted before it started
    prefill_s: float = 0.0
    time_s: float = 0.0
    decode_started: float = 0.0  # perf_counter at the row's first decoding step, and at its end
    finished: float = 0.0


def row_json(tokenizer, row: BatchRow, method: str) -> dict:
    """A prompt's result with the fields of a single run (stopped_by 'interrupt' if it never ran)."""
    result = row.result
    if result is None:
        return {"text": "", "tokens": [], "prompt_tokens": row.prompt_tokens, "new_tokens": 0, "method": method,
                "stopped_by": "interrupt"}
    return {"text": tokenizer.decode(result.tokens, skip_special_tokens=True), "tokens": result.tokens,
            "prompt_tokens": row.prompt_tokens, "new_tokens": len(result.tokens), "method": method,
            "time_s": round(row.time_s, 4), "prefill_s": round(row.prefill_s, 4),
            "decode_s": round(result.time_s, 4),
            "tokens_per_s": round(len(result.tokens) / result.time_s, 3) if result.time_s else None,
            "stopped_by": result.stopped_by, **result.stats}


@dataclass
class BatchOutcome:
    rows: list[BatchRow]      # every prompt's row, in order (empty for a streamed run: see decode_stream)
    time_s: float
    batch_size: int
    passes: int
    rows_per_pass: float
    tally: BatchTally = field(default_factory=BatchTally)


class RowModels(NamedTuple):
    """What one engine of a batch is built over: the target and draft whose models are RowModels
    (triforce.decoding.lockstep), to attach to the lane of the row the engine serves."""
    lm: object
    draft: Draft

    def models(self) -> tuple[RowModel, ...]:
        return (self.lm.model,) + ((self.draft.model.model,) if self.draft.kind == "model" else ())


def row_models(runtime) -> RowModels:
    """Fresh RowModels around the runtime's models: one set per engine."""
    lm = replace(runtime.lm, model=RowModel(runtime.lm.model))
    draft = runtime.draft
    if draft.kind == "model":
        draft = Draft("model", replace(draft.model, model=RowModel(draft.model.model)))
    return RowModels(lm, draft)


def generate_batch(runtime, prompts: list[list[int]], max_new: list[int], params, stop_ids: frozenset[int],
                   rows: int, run: RunPlan, on_row: Callable[[BatchRow], None] | None = None,
                   engines: list | None = None, on_prefill: Callable[[int], None] | None = None) -> BatchOutcome:
    """Decode every prompt (token ids) with at most `rows` at once; on_row(row) as each finishes,
    on_prefill(n) as prompt tokens are prefilled. engines: one (engine, RowModels it was built
    over) per prompt (a benchmark hands over prefilled caches). The outcome keeps every row."""
    if engines is not None and len(engines) != len(prompts):
        raise ValueError("one engine per prompt")
    done: list[BatchRow | None] = [None] * len(prompts)

    def finished(row: BatchRow) -> None:
        done[row.index] = row
        if on_row is not None:
            on_row(row)

    max_len = max(len(ids) + max(n, 1) for ids, n in zip(prompts, max_new))
    outcome = decode_stream(runtime, iter(zip(prompts, max_new)), params, stop_ids, rows, run, max_len, finished,
                            engines, on_prefill)
    outcome.rows = [row if row is not None else BatchRow(i, len(prompts[i]), None) for i, row in enumerate(done)]
    for row in outcome.rows:
        if row.result is None:  # never ran (an interrupt): counted as a prompt
            outcome.tally.add(row)
    return outcome


def decode_stream(runtime, prompts: Iterator[tuple[list[int], int]], params, stop_ids: frozenset[int], rows: int,
                  run: RunPlan, max_len: int, on_row: Callable[[BatchRow], None], engines: list | None = None,
                  on_prefill: Callable[[int], None] | None = None) -> BatchOutcome:
    """Decode (token ids, new tokens) pairs taken from `prompts` only as rows free up, at most
    `rows` at once, each at most max_len tokens long; on_row(row) as each finishes (its index:
    its place in `prompts`). Nothing is kept per prompt: the outcome's rows are empty and its
    tally adds up the figures, so any number of prompts runs in the memory of `rows` rows."""
    if engines is None:
        runtime.check_host_room(run, max_len, rows)
        free = []
        for _ in range(rows):
            models = row_models(runtime)
            free.append((runtime.engine(max_len, run, lm=models.lm, draft=models.draft, graphs="off"), models))
    lockstep = Lockstep(rows)
    tally = BatchTally()

    def task(index: int, ids: list[int], new: int, lane) -> None:
        engine, models = free.pop() if engines is None else engines[index]
        try:
            with lane.attach(*models.models()):  # this engine's passes now wait for the batch's
                started = time.perf_counter()
                engine.set_sequence(ids, on_prefill)
                if index < rows:  # the first rows start decoding together, once all have prefilled
                    lane.barrier()
                decode_started = time.perf_counter()
                result = engine.generate(new, params, stop_ids)
                finished = time.perf_counter()
            row = BatchRow(index, len(ids), result, decode_started - started, finished - started,
                           decode_started, finished)
        finally:
            if engines is None:
                free.append((engine, models))
        if result.stopped_by == "interrupt":
            lockstep.interrupt()
        tally.add(row)
        on_row(row)

    taken = 0

    def take(block: bool):
        nonlocal taken
        item = next(prompts, None)
        if item is None:
            return None
        index, taken = taken, taken + 1
        return lambda lane: task(index, item[0], item[1], lane)

    started = time.perf_counter()
    lockstep.serve(take)
    elapsed = time.perf_counter() - started
    return BatchOutcome([], elapsed, rows, lockstep.passes,
                        lockstep.rows_per_pass / lockstep.passes if lockstep.passes else 0.0, tally)
