"""`--method auto`: which method decodes (ar, naive, retrieval or triforce) and from which
sequence length speculation pays, chosen by the cost model from the profile and the context.

Each candidate gets its own plan and speculation choice (budget, gammas: see speculation_choice)
and a predicted ms/token at the run's context; ar's is one full-cache forward per token. The
fastest candidate is taken only when predicted AUTO_MARGIN times faster than ar: the whole-loop
model has been up to 34% optimistic on the CPU (bench/RESULTS.md), and a wrong pick must not cost
more than ar. Speculation's gain grows with the context (the KV outweighs the weights), so the
choice also says the shortest sequence from which the margin holds at every longer length up to
the context; below it the engine checks no drafts, one token per full-cache pass, as ar does (a
chat that starts short switches on its own as the conversation grows). This is auto's offline half;
its online half, which falls back to ar while the text drafts worse than predicted, is
triforce.decoding.speculation_gate; triforce.app.plan_and_cache wires both (plan_run and
RunPlan.speculation_gate)."""
from __future__ import annotations

from dataclasses import dataclass, replace

from triforce.config.model import ModelConfig
from triforce.plan.cost_model import (Acceptance, costs_at, full_verify_ms, naive_ms_per_token,
                                      rate_from_fraction, triforce_ms_per_token)
from triforce.plan.planner import hardware, plan_memory
from triforce.plan.profiles import MemoryProfile, acceptance_table
from triforce.plan.speculation_choice import measured_tier_acceptance, plan_with_choice

AUTO_MARGIN = 1.25
# acceptance where the profile has none measured: the lowest the default model showed with
# prompt-lookup drafts on natural text (`eval acceptance --drafts lookup`, 8K tokens, greedy and
# T=0.6; bench/history/2026-11-26-natural-text.md). The full tier kept 0.65 of gamma2 = 8 drafts: a per-token
# rate of 0.90. The retrieval tier kept 0.16 of gamma1 = 4 lookup drafts at T=0.6 (0.53 greedy);
# that fraction stays as the rate, because prompt lookup proposes nothing at many steps, which
# the fraction does not count and the model has no term for. (Text that repeats itself gave
# 0.68 and 0.45, and auto picked speculation where natural text made it slower.)
AUTO_ASSUMED = Acceptance(full=rate_from_fraction(0.65, 8), retrieval=0.16)
SHORTEST = 256  # lengths tried for the switch-over: SHORTEST, 1.5x, 2x, ... up to the context
# Where ar is picked at the assumed acceptance but a method would pay at this acceptance (text that
# repeats: a quoted document, an edited file), the engine decodes as ar and tries that method now
# and then (triforce.decoding.speculation_gate): the text at hand decides, which no prediction
# knows. On a CPU that is naive up to ~8K (lookup drafts checked by the full cache; retrieval's
# self-drafts cost a step each and do not pay even when all are kept) and triforce beyond.
BEST_CASE = Acceptance(full=0.99, retrieval=0.9)


@dataclass(frozen=True)
class MethodChoice:
    method: str
    speculate_from: int         # sequence length from which speculation runs (0: from the start)
    context: int
    predicted_ms: dict          # method -> predicted ms/token at the context (ar included)
    probe: str | None = None    # with ar: the method tried now and then (its tiers are built)

    @property
    def speedup(self) -> float:
        return self.predicted_ms["ar"] / self.predicted_ms[self.method]

    def to_json(self) -> dict:
        return {"method": self.method, "speculate_from": self.speculate_from, "context": self.context,
                "margin": AUTO_MARGIN, "probe": self.probe,
                "predicted_ms_per_token": {m: round(v, 3) for m, v in self.predicted_ms.items()}}

    def describe(self) -> str:
        ratios = ", ".join(f"{m} {self.predicted_ms['ar'] / v:.2f}x" for m, v in self.predicted_ms.items() if m != "ar")
        if self.method == "ar":
            tries = f"; trying {self.probe} now and then, kept where it pays" if self.probe else ""
            return (f"method auto: ar (predicted at {self.context} tokens, vs ar: {ratios or 'nothing else fits'}; "
                    f"speculation needs {AUTO_MARGIN}x{tries})")
        start = f", ar below {self.speculate_from} tokens" if self.speculate_from else ""
        return f"method auto: {self.method} (predicted {self.speedup:.2f}x of ar at {self.context} tokens{start})"


def default_acceptance(profile: MemoryProfile) -> Acceptance:
    """What every prediction assumes without --acceptance: the profile's measured lookup rows
    (`eval acceptance --drafts`, stored by `profile tune --acceptance`), else AUTO_ASSUMED."""
    return measured_tier_acceptance(acceptance_table(profile)) or AUTO_ASSUMED


def lengths(context: int) -> list[int]:
    out, n = [], SHORTEST
    while n < context:
        out.append(n)
        n = int(n * 1.5) if len(out) % 2 else n * 4 // 3
    return out + [context]


def choose_method(model: ModelConfig, profile: MemoryProfile, context: int, spec, fixed: frozenset[str], *,
                  dtype_bytes: int, draft: ModelConfig | None = None, draft_dtype_bytes: int | None = None,
                  tp: int = 1, has_tier0: bool = True, assumed: Acceptance | None = None, weights: str | None = None):
    """(MethodChoice, the spec to run: the chosen method with its budget and gammas). assumed:
    the acceptance to predict with (default: what the profile measured with lookup drafts, else
    AUTO_ASSUMED)."""
    assumed = assumed or default_acceptance(profile)
    hw = hardware(profile, dtype_bytes)
    ar_spec = replace(spec, method="ar")
    ar_plan = plan_memory(model, profile, context, ar_spec, dtype_bytes=dtype_bytes, tp=tp, weights=weights)
    ar_costs = ar_plan.step_costs

    def ar_ms(length: int) -> float:
        return full_verify_ms(costs_at(ar_costs, ar_plan.decode_resident_tokens, length), hw, 1)

    predicted = {"ar": ar_ms(context)} if ar_costs is not None else {}
    timings, specs, best_case = {}, {}, {}
    methods = ("triforce", "retrieval", "naive") if has_tier0 else ("retrieval",)
    for method in methods:
        drafts = method in ("triforce", "naive")
        candidate = replace(spec, method=method)
        plan, candidate, choice = plan_with_choice(
            model, profile, context, candidate, fixed, dtype_bytes=dtype_bytes, draft=draft if drafts else None,
            draft_dtype_bytes=draft_dtype_bytes if drafts else None, tp=tp, assumed=assumed,
            has_tier0=drafts, weights=weights)
        if not plan.feasible or plan.step_costs is None or ar_costs is None:
            continue
        acceptance = choice.acceptance if choice is not None else assumed
        timings[method] = _timing(method, plan, candidate, acceptance, hw)
        predicted[method] = timings[method](context)
        specs[method] = candidate
        best_case[method] = _timing(method, plan, candidate, BEST_CASE, hw)(context)
    fastest = min(timings, key=lambda m: predicted[m], default=None)
    if fastest is None or predicted["ar"] < AUTO_MARGIN * predicted[fastest]:
        hopeful = min(best_case, key=best_case.get, default=None)
        if hopeful is not None and predicted["ar"] >= AUTO_MARGIN * best_case[hopeful]:
            return MethodChoice("ar", 0, context, predicted, probe=hopeful), specs[hopeful]
        return MethodChoice("ar", 0, context, predicted), ar_spec
    grid = lengths(context)
    start = context
    for length in reversed(grid):  # the longest run of lengths, ending at the context, that pays
        if ar_ms(length) < AUTO_MARGIN * timings[fastest](length):
            break
        start = length
    speculate_from = 0 if start == grid[0] else start
    return MethodChoice(fastest, speculate_from, context, predicted), specs[fastest]


def _timing(method: str, plan, spec, acceptance: Acceptance, hw):
    """length -> predicted ms/token of `method` under `plan` once the sequence is that long."""
    def ms(length: int) -> float:
        costs = costs_at(plan.step_costs, plan.decode_resident_tokens, length)
        if method == "naive":
            return naive_ms_per_token(costs, hw, acceptance.retrieval, spec.gamma2)
        return triforce_ms_per_token(costs, hw, acceptance, spec.gamma1, spec.gamma2,
                                     has_tier0=method == "triforce")["triforce_ms_per_token"]
    return ms
