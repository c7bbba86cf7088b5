"""Sampling the first tokens of a method many times, split over worker processes.

Each job loads the models itself (spawned workers, so nothing is shared with the test process)
and seeds its own generator, so the counts are deterministic whatever the scheduling and
whichever worker runs it. A test module may keep one pool for all its calls (`sampling_pool`):
starting one (fresh interpreters importing torch) took seconds per call."""
from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing as mp
import os

import torch

from triforce.config import SamplingParams, SpecParams
from triforce.decoding.engine import Engine
from triforce.decoding.verification import Verdict
from triforce.model.loading import load_model


def p_direct_shortcut(drafts, draft_probs, target_probs, generator):
    """The known bug: after a rejection, sample from p instead of the residual max(0, p - q)."""
    for i, token in enumerate(drafts):
        q = draft_probs[i]
        q_token = 1.0 if q is None else float(q[token])
        if float(torch.rand((), generator=generator, dtype=torch.float64)) < float(target_probs[i][token]) / q_token:
            continue
        return Verdict(i, int(torch.multinomial(target_probs[i], 1, generator=generator)))
    return Verdict(len(drafts), int(torch.multinomial(target_probs[len(drafts)], 1, generator=generator)))


class BrokenEngine(Engine):
    """An engine whose `broken_level` checks its drafts with p_direct_shortcut (the chi-square
    tests must catch it); every other level verifies as the runtime does."""

    def __init__(self, *args, broken_level: str | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.broken_level = broken_level

    def sampled_verdict(self, tier_name, drafts, draft_dists, probs, position):
        if tier_name == self.broken_level:
            return p_direct_shortcut(drafts, draft_dists, probs, self.draws.generator)
        return super().sampled_verdict(tier_name, drafts, draft_dists, probs, position)


def _worker(job) -> dict:
    target_dir, draft_dir, spec_kwargs, drafter, params, prompt_ids, new_tokens, samples, seed, broken_level = job
    torch.set_num_threads(1)
    spec_kwargs = dict(spec_kwargs)
    draft_ahead = spec_kwargs.pop("draft_ahead", False)  # an engine setting carried with the spec's
    quantize = spec_kwargs.pop("quantize", None)  # a load setting (block-quantized weights), likewise
    seeded = spec_kwargs.pop("seeded", False)  # each sample a seeded request of its own (PositionNoise)
    with stale_penalties(broken_level == "stale-penalty"):
        return _counts(target_dir, draft_dir, spec_kwargs, drafter, params, prompt_ids, new_tokens, samples, seed,
                       broken_level, draft_ahead, quantize, seeded)


@contextlib.contextmanager
def stale_penalties(planted: bool):
    """A planted bug, in this process only while the job runs (a pool's worker runs others after
    it): every tier's penalties miss the last token of its context."""
    from triforce.decoding import engine as engine_module

    real = engine_module.penalize
    if planted:
        engine_module.penalize = lambda rows, seq, p: real(rows, seq[:-1], p)
    try:
        yield
    finally:
        engine_module.penalize = real


def _counts(target_dir, draft_dir, spec_kwargs, drafter, params, prompt_ids, new_tokens, samples, seed, broken_level,
            draft_ahead, quantize, seeded=False) -> dict:
    target = load_model(target_dir, dtype="float32", device="cpu", quantize=quantize)
    draft = load_model(draft_dir, dtype="float32", device="cpu", quantize=quantize) if drafter == "model" else drafter
    engine = BrokenEngine(target, SpecParams(**spec_kwargs), len(prompt_ids) + new_tokens + 2, draft,
                          broken_level=broken_level, draft_ahead=draft_ahead)
    generator = torch.Generator().manual_seed(seed)
    counts: dict = {}
    for k in range(samples):
        engine.set_sequence(prompt_ids)
        if seeded:  # seeds seed * 10^6 + k: the workers' never overlap
            tokens = tuple(engine.generate(new_tokens, dataclasses.replace(params, seed=seed * 10**6 + k)).tokens)
        else:
            tokens = tuple(engine.generate(new_tokens, params, generator=generator).tokens)
        counts[tokens] = counts.get(tokens, 0) + 1
    return counts


WORKERS = min(2, os.cpu_count() or 1)


def sampling_pool(workers: int = WORKERS):
    """Spawned worker processes for sample_counts and batch_sample_counts (a context manager)."""
    return mp.get_context("spawn").Pool(workers)


def _run_workers(worker, job_head: tuple, samples: int, broken_level: str | None, workers: int, pool) -> list:
    """worker(job) for `workers` jobs, the samples split between them, each seeded by its index,
    on `pool` (or a pool of their own); the parts in order."""
    share = [samples // workers + (i < samples % workers) for i in range(workers)]
    jobs = [(*job_head, n, 1234 + i, broken_level) for i, n in enumerate(share)]
    if pool is not None:
        return pool.map(worker, jobs)
    with sampling_pool(workers) as own:
        return own.map(worker, jobs)


def _add(total: dict, part: dict) -> dict:
    for cell, n in part.items():
        total[cell] = total.get(cell, 0) + n
    return total


def sample_counts(target_dir: str, draft_dir: str, spec_kwargs: dict, drafter, params: SamplingParams,
                  prompt_ids: list[int], new_tokens: int, samples: int, broken_level: str | None = None,
                  workers: int = WORKERS, pool=None) -> dict:
    parts = _run_workers(_worker, (target_dir, draft_dir, spec_kwargs, drafter, params, prompt_ids, new_tokens),
                         samples, broken_level, workers, pool)
    total: dict = {}
    for part in parts:
        _add(total, part)
    return total


def _batch_worker(job) -> list[dict]:
    """Samples of several prompts decoded as rows of one lockstep batch (triforce.decoding.lockstep):
    each prompt's row runs `samples` times, with a generator of its own."""
    import dataclasses

    from triforce.decoding.lockstep import Lockstep, RowModel

    target_dir, draft_dir, spec_kwargs, drafter, params, prompts, new_tokens, samples, seed, broken_level = job
    torch.set_num_threads(1)
    target = load_model(target_dir, dtype="float32", device="cpu")
    loaded = load_model(draft_dir, dtype="float32", device="cpu") if drafter == "model" else None
    longest = max(map(len, prompts)) + new_tokens + 2
    engines, models = [], []  # one engine per row, over RowModels of its own
    for _ in prompts:
        row_target = RowModel(target.model)
        row_draft = RowModel(loaded.model) if loaded is not None else None
        draft = dataclasses.replace(loaded, model=row_draft) if loaded is not None else drafter
        engines.append(BrokenEngine(dataclasses.replace(target, model=row_target), SpecParams(**spec_kwargs), longest,
                                    draft, graphs="off", broken_level=broken_level))
        models.append([m for m in (row_target, row_draft) if m is not None])
    generators = [torch.Generator().manual_seed(seed * 100 + r) for r in range(len(prompts))]
    counts: list[dict] = [{} for _ in prompts]

    def row(r: int, lane) -> None:
        with lane.attach(*models[r]):
            for _ in range(samples):
                engines[r].set_sequence(prompts[r])
                tokens = tuple(engines[r].generate(new_tokens, params, generator=generators[r]).tokens)
                counts[r][tokens] = counts[r].get(tokens, 0) + 1

    Lockstep(len(prompts)).run([lambda lane, r=r: row(r, lane) for r in range(len(prompts))])
    return counts


def batch_sample_counts(target_dir: str, draft_dir: str, spec_kwargs: dict, drafter, params: SamplingParams,
                        prompts: list[list[int]], new_tokens: int, samples: int, broken_level: str | None = None,
                        workers: int = WORKERS, pool=None) -> list[dict]:
    """Per prompt, the counts of its first tokens over `samples` batched runs."""
    parts = _run_workers(_batch_worker, (target_dir, draft_dir, spec_kwargs, drafter, params, prompts, new_tokens),
                         samples, broken_level, workers, pool)
    total: list[dict] = [{} for _ in prompts]
    for part in parts:
        for r, counts in enumerate(part):
            _add(total[r], counts)
    return total
