"""Choosing the speculation parameters (retrieval budget, chunk size, gamma1, gamma2 and the range
gamma2 may adapt in) for a model, a context and a profile, by the cost model.

Acceptance of the full tier per (budget, chunk size) comes from `triforce eval acceptance` rows
stored with the profile (`profile tune --acceptance`), or a measured rate passed in (`plan
--acceptance`). Without either, nothing is chosen: the defaults stand, and predictions say their
acceptance is assumed."""
from __future__ import annotations

from dataclasses import dataclass, replace

from triforce.config.model import ModelConfig
from triforce.plan.cost_model import Acceptance, GAMMA1_RANGE, GAMMA2_RANGE, best_gammas, gamma2_bounds
from triforce.offload.errors import OffloadError
from triforce.plan.planner import hardware, plan_memory
from triforce.plan.profiles import MemoryProfile, acceptance_table

TUNABLE = ("budget", "chunk_size", "gamma1", "gamma2")


@dataclass(frozen=True)
class Choice:
    budget: int
    chunk_size: int
    gamma1: int
    gamma2: int
    gamma2_min: int
    gamma2_max: int
    predicted_ms_per_token: float
    acceptance: Acceptance

    def spec_changes(self) -> dict:
        return {"budget": self.budget, "chunk_size": self.chunk_size, "gamma1": self.gamma1, "gamma2": self.gamma2,
                "gamma2_min": self.gamma2_min, "gamma2_max": self.gamma2_max}


def measured_acceptance(rows: list[dict], policy: str) -> dict[tuple[int, int], float]:
    """{(budget, chunk size): expected acceptance} of one policy from eval acceptance rows."""
    table = {}
    for row in rows:
        if row.get("policy") == policy and "budget" in row and "expected_accept" in row:
            table[(int(row["budget"]), int(row.get("chunk_size", 8)))] = float(row["expected_accept"])
    return table


def measured_tier_acceptance(rows: list[dict], draft: str = "lookup") -> Acceptance | None:
    """The lowest acceptance measured per tier with this tier 0 (rows of `eval acceptance --drafts`,
    over the texts and temperatures measured): the full tier's per-token rate, and the retrieval
    tier's kept fraction of tier-0 drafts (prompt lookup often proposes nothing, which a per-token
    rate would not count). None without such rows."""
    mine = [r for r in rows if r.get("draft") == draft and "full" in r.get("per_token_rates", {})]
    if not mine:
        return None
    full = min(r["per_token_rates"]["full"] for r in mine)
    kept = [r["acceptance_rates"]["retrieval"] for r in mine if "retrieval" in r.get("acceptance_rates", {})]
    return Acceptance(full=full, retrieval=min(kept) if kept else Acceptance().retrieval, measured=True)


def choose_speculation(model: ModelConfig, profile: MemoryProfile, context: int, spec, *, dtype_bytes: int,
                       fixed: frozenset[str] = frozenset(), draft: ModelConfig | None = None, tp: int = 1,
                       rows: list[dict] = (), assumed: Acceptance = Acceptance(),
                       has_tier0: bool | None = None, weights: str | None = None) -> Choice | None:
    """The lowest predicted ms/token over measured (budget, chunk) pairs and the gamma grid,
    keeping the `fixed` fields as given. None when no candidate fits the profile."""
    policy = spec.sparse_policy
    table = measured_acceptance(list(rows), policy)
    candidates = [(b, c, Acceptance(a, assumed.retrieval, measured=True)) for (b, c), a in sorted(table.items())
                  if ("budget" not in fixed or b == spec.budget) and ("chunk_size" not in fixed or c == spec.chunk_size)]
    if not candidates:
        candidates = [(spec.budget, spec.chunk_size, assumed)]
    has_tier0 = spec.method == "triforce" and (draft is not None if has_tier0 is None else has_tier0)
    g1_range = (spec.gamma1,) if "gamma1" in fixed or not has_tier0 else GAMMA1_RANGE
    g2_range = (spec.gamma2,) if "gamma2" in fixed else GAMMA2_RANGE
    hw = hardware(profile, dtype_bytes)
    best = None
    for budget, chunk, acceptance in candidates:
        widest = replace(spec, budget=budget, chunk_size=chunk, gamma1=max(g1_range), gamma2=max(g2_range),
                         gamma2_min=None, gamma2_max=None)
        plan = plan_memory(model, profile, context, widest, dtype_bytes=dtype_bytes, draft=draft, tp=tp,
                           has_tier0=has_tier0, weights=weights)
        if not plan.feasible:
            continue
        g1, g2, ms = best_gammas(plan.step_costs, hw, acceptance, has_tier0, g1_range, g2_range)
        if best is None or ms < best[0]:
            best = (ms, budget, chunk, g1, g2, acceptance, plan.step_costs)
    if best is None:
        return None
    ms, budget, chunk, g1, g2, acceptance, costs = best
    low, high = (g2, g2) if "gamma2" in fixed else gamma2_bounds(costs, hw, acceptance, g1, has_tier0)
    return Choice(budget, chunk, g1, g2, min(low, g2), max(high, g2), ms, acceptance)


def within_context(spec, fixed: frozenset[str], model: ModelConfig, context: int):
    """Refuse sizes the user gave that no context of this model can use (they would only
    inflate the plan until some unrelated buffer took the blame); a rebuild stride past the
    context never triggers, so it is the same as the context itself. Plain decoding uses none of
    them: its sizes are left unchecked."""
    limit = max(context, model.max_position_embeddings)
    for name in sorted(fixed & {"budget", "gamma1", "gamma2", "chunk_size"} if spec.method != "ar" else ()):
        if getattr(spec, name) >= limit:
            raise OffloadError(f"--{name.replace('_', '-')} {getattr(spec, name)} must be below the "
                               f"model's context of {limit} tokens")
    return replace(spec, rebuild_stride=min(spec.rebuild_stride, context))


def plan_with_choice(model: ModelConfig, profile: MemoryProfile, context: int, spec, fixed: frozenset[str], *,
                     dtype_bytes: int, draft: ModelConfig | None = None, draft_dtype_bytes: int | None = None,
                     tp: int = 1, assumed: Acceptance = Acceptance(), has_tier0: bool | None = None,
                     weights: str | None = None):
    """Choose what the user left open (budget, chunk size, gammas) by the cost model, with the
    acceptance measured for the profile where there is some, then plan memory for it.
    Returns (MemoryPlan, spec with the choices, Choice or None)."""
    spec = within_context(spec, fixed, model, context)
    choice = None
    rows = acceptance_table(profile)
    policy = spec.sparse_policy
    measured = bool(measured_acceptance(rows, policy)) or assumed.measured
    # without measured acceptance the defaults (themselves measured, bench/RESULTS.md) stand
    if spec.uses_sparse_cache and measured and not set(TUNABLE) <= fixed:
        choice = choose_speculation(model, profile, context, spec, dtype_bytes=dtype_bytes, fixed=fixed,
                                    draft=draft if spec.method == "triforce" else None, tp=tp,
                                    rows=rows, assumed=assumed, has_tier0=has_tier0, weights=weights)
        if choice is not None:
            spec = replace(spec, **choice.spec_changes())
    plan = plan_memory(model, profile, context, spec, dtype_bytes=dtype_bytes, draft=draft,
                       draft_dtype_bytes=draft_dtype_bytes, tp=tp, has_tier0=has_tier0, weights=weights,
                       acceptance=choice.acceptance if choice is not None else assumed)
    return plan, spec, choice
