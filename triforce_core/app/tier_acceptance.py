"""Acceptance per tier of the real decoding loop: tier 0 (lookup or a draft model) checked by
the retrieval tier, the retrieval tier checked by the full cache, for each tier 0 and
temperature, over one shared prefill of the prompt. What the cost model and `--method auto`
should assume comes from here (`triforce eval acceptance --drafts ...`)."""
from __future__ import annotations

from dataclasses import replace
from typing import Callable

from triforce.config import SamplingParams, SpecParams
from triforce.decoding.draft import Draft
from triforce.decoding.engine import Engine
from triforce.decoding.sampling import make_generator
from triforce.model.loading import LoadedModel
from triforce.plan.cost_model import rate_from_fraction


def evaluate_tiers(lm: LoadedModel, ids: list[int], drafts: dict[str, Draft], temperatures: list[float], gen: int,
                   spec: SpecParams, seed: int = 0, log: Callable[[str], None] | None = None,
                   on_prefill: Callable[[int], None] | None = None) -> list[dict]:
    """One row per (tier 0, temperature): each tier's fraction of drafts kept and the per-token
    rate the cost model uses for it (a check stops at its first rejection, so keeping 0.68 of 8
    drafts means a per-token rate of about 0.91), tokens per full verify, tier seconds."""
    rows, cache = [], None
    for name, draft in drafts.items():
        run_spec = replace(spec, method="triforce" if draft.has_tier0 else "retrieval")
        for temperature in temperatures:
            engine = Engine(lm, run_spec, len(ids) + gen + 1, draft, kv_cache=cache)
            if cache is not None:
                engine.full.adopt(ids[:-1])  # the prompt's KV, prefilled once for every row
            engine.set_sequence(ids, on_prefill if cache is None else None)
            cache = engine.full.cache
            # a generator, not a seeded request: the acceptance of speculative sampling's test, which
            # unseeded requests run (a seeded one accepts by its position's noise: decoding.sampling)
            generator = make_generator(SamplingParams(seed=seed), lm.device)
            result = engine.generate(gen, SamplingParams(temperature=temperature), generator=generator)
            rows.append(_row(name, temperature, run_spec, result, len(ids)))
            if log is not None:
                log(f"{name} T={temperature}: {rows[-1]['acceptance_rates']}, "
                    f"{rows[-1]['mean_tokens_per_full_verify']} tokens per full verify")
    return rows


def _row(draft: str, temperature: float, spec: SpecParams, result, prompt_tokens: int) -> dict:
    stats = result.stats
    kept = stats["acceptance_rates"]
    gammas = {"full": spec.gamma2, "retrieval": spec.gamma1}
    rates = {tier: rate_from_fraction(fraction, gammas.get(tier, spec.gamma1)) for tier, fraction in kept.items()}
    return {"draft": draft, "temperature": temperature, "prompt_tokens": prompt_tokens, "new_tokens": len(result.tokens),
            "tiers": stats["tiers"], "budget": spec.budget, "gamma1": spec.gamma1, "gamma2": spec.gamma2,
            "acceptance_rates": kept, "per_token_rates": rates, "proposed": stats["proposed"],
            "mean_tokens_per_full_verify": stats["mean_tokens_per_full_verify"],
            "full_verifies": stats["full_verifies"], "tier_time_s": stats["tier_time_s"],
            "tokens_per_s": round(len(result.tokens) / result.time_s, 2)}
