"""Many prompts decoded as one batch (`generate --prompts`): each row has its own engine (caches,
tiers, sampler), the rows' forward passes run together (triforce.decoding.lockstep), and a row
that finishes hands its engine to the next prompt waiting.

The memory plan is made for one row with 1/B of what the device has beside the weights, which
every row shares; so B rows of that plan fit together. The default batch size is the most rows
(up to the number of prompts) whose plan fits."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field, replace
from typing import Callable, NamedTuple

from triforce.app.inputs import is_utf8
from triforce.app.plan_and_cache import RunPlan
from triforce.config import AUTO
from triforce.decoding.draft import Draft
from triforce.decoding.lockstep import Lockstep, RowModel
from triforce.decoding.statistics import GenerationResult
from triforce.errors import UserError

PROMPTS_FILE_BYTES = 256 << 20  # a prompts file is read whole: refuse a larger one unread


def parse_prompt_lines(text: str, source: str) -> list[str]:
    """JSON lines, one {"prompt": "..."} each (blank lines skipped) -> the prompts, in order."""
    prompts = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"{source} line {number} is not JSON ({e.msg})") from None
        prompt = item.get("prompt") if isinstance(item, dict) else None
        if not isinstance(prompt, str):
            raise UserError(f'{source} line {number} has no "prompt" string (expected {{"prompt": "..."}})')
        if not is_utf8(prompt):
            raise UserError(f"{source} line {number}: the prompt is not valid Unicode text")
        prompts.append(prompt)
    if not prompts:
        raise UserError(f"{source} holds no prompts")
    return prompts


def row_plan(runtime, max_len: int, rows: int, spec=None, fixed: frozenset | None = None) -> RunPlan:
    """The plan of one row when `rows` rows share the device: the weights once, the rest split.
    --method auto picks the method, budget and gammas for the batch (triforce.offload.batch_choice).
    spec, fixed: instead of the runtime's (a benchmark running several methods)."""
    from triforce.offload.batch_choice import choose_for_batch, predict_batch, row_profile, spec_for

    lm, choice = runtime.lm, None
    spec = spec or runtime.config.spec
    fixed = runtime.config.fixed if fixed is None else fixed
    if spec.method == AUTO:
        predictions = predict_batch(lm.config, runtime.profile, max_len, rows, spec, dtype_bytes=lm.dtype.itemsize,
                                    fixed=fixed)
        if not predictions:
            raise UserError(f"no method fits a batch of {rows} rows of {max_len} tokens in profile "
                            f"{runtime.profile.name}")
        choice = choose_for_batch(predictions)
        spec, fixed = spec_for(choice.chosen, spec, fixed)
    draft = runtime.draft.model if runtime.draft.kind == "model" else None
    profile = row_profile(lm.config, runtime.profile, rows, lm.dtype.itemsize, draft=draft and draft.config,
                          draft_dtype_bytes=draft and draft.dtype.itemsize)
    return replace(runtime.plan(max_len, spec=spec, fixed=fixed, profile=profile), batch=choice)


def fit_batch(runtime, max_len: int, prompts: int, wanted: int | None) -> tuple[int, RunPlan]:
    """The batch size (wanted, or the most rows up to `prompts` that fit) and one row's plan."""
    if wanted is not None:
        if wanted < 1:
            raise UserError(f"--batch-size must be >= 1, got {wanted}")
        rows = min(wanted, prompts)
        return rows, _feasible(runtime, max_len, rows)
    best = (1, row_plan(runtime, max_len, 1))  # the error of a single row, if even that cannot fit
    low, high = 2, prompts  # a row's share only shrinks as rows are added: bisect for the most that fit
    while low <= high:
        rows = (low + high) // 2
        try:
            best = (rows, row_plan(runtime, max_len, rows))
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


@dataclass
class BatchOutcome:
    rows: list[BatchRow]
    time_s: float
    batch_size: int
    passes: int
    rows_per_pass: float
    stats: dict = field(default_factory=dict)


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
    over) per prompt (a benchmark hands over prefilled caches)."""
    max_len = max(len(ids) + max(n, 1) for ids, n in zip(prompts, max_new))
    if engines is None:
        runtime.check_host_room(run, max_len, rows)
        free = []
        for _ in range(rows):
            models = row_models(runtime)
            free.append((runtime.engine(max_len, run, lm=models.lm, draft=models.draft, graphs="off"), models))
    elif len(engines) != len(prompts):
        raise ValueError("one engine per prompt")
    lockstep = Lockstep(rows)

    def task(index: int, lane) -> BatchRow:
        engine, models = free.pop() if engines is None else engines[index]
        try:
            with lane.attach(*models.models()):  # this engine's passes now wait for the batch's
                started = time.perf_counter()
                engine.set_sequence(prompts[index], on_prefill)
                if index < rows:  # the first rows start decoding together, once all have prefilled
                    lane.barrier()
                decode_started = time.perf_counter()
                result = engine.generate(max_new[index], params, stop_ids)
                finished = time.perf_counter()
            row = BatchRow(index, len(prompts[index]), result, decode_started - started, finished - started,
                           decode_started, finished)
        finally:
            if engines is None:
                free.append((engine, models))
        if result.stopped_by == "interrupt":
            lockstep.interrupt()
        if on_row is not None:
            on_row(row)
        return row

    started = time.perf_counter()
    done = lockstep.run([lambda lane, i=i: task(i, lane) for i in range(len(prompts))])
    elapsed = time.perf_counter() - started
    out = [row if row is not None else BatchRow(i, len(prompts[i]), None) for i, row in enumerate(done)]
    return BatchOutcome(out, elapsed, rows, lockstep.passes,
                        lockstep.rows_per_pass / lockstep.passes if lockstep.passes else 0.0, _pooled(out))


def _pooled(rows: list[BatchRow]) -> dict:
    """The rows' speculation counts added up: acceptance per tier, tokens per full verify."""
    proposed: dict[str, int] = {}
    accepted: dict[str, int] = {}
    verifies = emitted = 0
    for row in rows:
        if row.result is None:
            continue
        stats = row.result.stats
        for name, n in stats.get("proposed", {}).items():
            proposed[name] = proposed.get(name, 0) + n
            accepted[name] = accepted.get(name, 0) + stats["accepted"][name]
        if stats.get("full_verifies"):
            verifies += stats["full_verifies"]
            emitted += len(row.result.tokens)
    return {"acceptance_rates": {k: round(accepted[k] / n, 4) for k, n in proposed.items() if n},
            "mean_tokens_per_full_verify": round(emitted / verifies, 4) if verifies else None}


def batch_summary(outcome: BatchOutcome) -> dict:
    """Throughput: new tokens of all rows per second from the first row's first decoding step to
    the last row's end (end_to_end: per second of the whole run, prefills included); per-token
    latency: each row's decoding time over its tokens, averaged over the rows."""
    ran = [r for r in outcome.rows if r.result is not None]
    finished = [r for r in ran if r.result.tokens]
    new_tokens = sum(len(r.result.tokens) for r in ran)
    latency = [r.result.time_s / len(r.result.tokens) for r in finished]
    decoding = max(r.finished for r in ran) - min(r.decode_started for r in ran) if ran else 0.0
    return {
        "prompts": len(outcome.rows),
        "batch_size": outcome.batch_size,
        "new_tokens": new_tokens,
        "time_s": round(outcome.time_s, 4),
        "throughput_tok_s": round(new_tokens / decoding, 3) if decoding > 0 else None,
        "end_to_end_tok_s": round(new_tokens / outcome.time_s, 3) if outcome.time_s else None,
        "latency_ms_per_token": round(1000 * sum(latency) / len(latency), 3) if latency else None,
        "forward_passes": outcome.passes,
        "rows_per_pass": round(outcome.rows_per_pass, 3),
        **outcome.stats,
    }
