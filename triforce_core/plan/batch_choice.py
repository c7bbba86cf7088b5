"""How a batch should decode: MagicDec's analysis through the cost model (triforce.plan.cost_model).

For B sequences of a context, a pass reads the weights once and each row's KV, so as the batch
and the context grow the KV outweighs the weights and a decoding step becomes B attentions over
the full KV. Self-speculation then pays: drafting steps attend over a small draft KV (StreamingLLM
or SnapKV selection, or retrieval), and one verify pass checks gamma drafts of every row against
the full KV. Two ratios decide it: the draft step against a target step (weights + B small
attentions vs weights + B full ones) and a verify of gamma + 1 tokens against a decoding step
(memory-bound on a GPU, so nearly free; compute-bound for the CPU's attention, several times a
step). The batch size from which speculation wins at a context is the crossover (MagicDec's
critical sequence length read the other way round).

Every candidate gets the plan of one row when B rows share the device (the weights once, the
rest split), the gammas (and budget) the model predicts fastest, and a predicted ms per token per
sequence; throughput is B tokens per that time."""
from __future__ import annotations

from dataclasses import dataclass, replace

from triforce.config.model import ModelConfig
from triforce.plan.cost_model import (GAMMA1_RANGE, GAMMA2_RANGE, Acceptance, best_gammas, full_verify_ms,
                                      tier1_ms)
from triforce.plan.method_choice import AUTO_ASSUMED, AUTO_MARGIN
from triforce.plan.planner import hardware, plan_memory
from triforce.plan.profiles import MemoryProfile, acceptance_table
from triforce.offload.shapes import weight_bytes
from triforce.plan.speculation_choice import measured_acceptance

# Full-tier acceptance of each self-speculation draft policy where the profile has none measured:
# the fractions of drafts kept on 8K-token prose by the default model
# (bench/history/2026-11-24-snapkv-batches-serve.md, "SnapKV drafts"), taken as the per-token
# rate (which is at least the fraction kept: conservative).
SELF_ASSUMED = {"streaming": 0.82, "snapkv": 0.95, "retrieval": 0.93}
BUDGETS = (256, 512, 1024, 2048)  # draft KV sizes tried where the user gave none
SELF_METHODS = ("streaming", "snapkv", "retrieval")


@dataclass(frozen=True)
class BatchPrediction:
    method: str
    rows: int
    ms_per_token: float    # per sequence: the latency a row's user sees
    budget: int | None = None
    gamma2: int | None = None
    gamma1: int | None = None
    acceptance: float | None = None  # the full tier's, as assumed or measured
    # MagicDec's two ratios: a draft step's time over a target decoding step's, and a verify
    # pass's (gamma2 + 1 tokens per row) over a decoding step's
    draft_to_target: float | None = None
    verify_to_decode: float | None = None

    @property
    def tokens_per_s(self) -> float:
        return 1000 * self.rows / self.ms_per_token

    def to_json(self) -> dict:
        return {"method": self.method, "rows": self.rows, "ms_per_token": round(self.ms_per_token, 3),
                "tokens_per_s": round(self.tokens_per_s, 2), "budget": self.budget, "gamma1": self.gamma1,
                "gamma2": self.gamma2, "acceptance": self.acceptance,
                "draft_to_target": self.draft_to_target, "verify_to_decode": self.verify_to_decode}


def row_profile(model: ModelConfig, profile: MemoryProfile, rows: int, dtype_bytes: int, tp: int = 1,
                draft: ModelConfig | None = None, draft_dtype_bytes: int | None = None) -> MemoryProfile:
    """The profile one row of `rows` plans in: the weights every row shares (the target's and a
    draft model's), and 1/rows of the rest."""
    if rows == 1:
        return profile
    shared = weight_bytes(model, dtype_bytes, tp)
    if draft is not None:
        shared += weight_bytes(draft, draft_dtype_bytes or dtype_bytes)
    room = max(profile.device_budget_bytes - shared, 0)
    return profile.with_device_budget(max(shared + room // rows, 1))


def predict_batch(model: ModelConfig, profile: MemoryProfile, context: int, rows: int, spec, *, dtype_bytes: int,
                  fixed: frozenset[str] = frozenset(), tp: int = 1, methods=("ar", *SELF_METHODS, "triforce"),
                  ) -> list[BatchPrediction]:
    """Each method's predicted time per token per sequence for `rows` sequences of `context`
    tokens (lookup drafts for triforce); a method whose plan does not fit is left out."""
    share = row_profile(model, profile, rows, dtype_bytes, tp)
    hw = hardware(profile, dtype_bytes)
    table = acceptance_table(profile)
    out = []
    for method in methods:
        candidate = replace(spec, method=method, gamma2_min=None, gamma2_max=None)
        if method == "ar":
            plan = plan_memory(model, share, context, candidate, dtype_bytes=dtype_bytes, tp=tp)
            if plan.feasible:
                out.append(BatchPrediction("ar", rows, full_verify_ms(plan.step_costs, hw, 1, rows)))
            continue
        budgets = (spec.budget,) if "budget" in fixed else tuple(b for b in BUDGETS if b < context)
        best = None
        for budget in budgets:
            if method == "snapkv" and budget <= spec.snapkv_window:
                continue
            prediction = _speculative(model, share, hw, context, rows, replace(candidate, budget=budget), fixed,
                                      dtype_bytes, tp, table)
            if prediction is not None and (best is None or prediction.ms_per_token < best.ms_per_token):
                best = prediction
        if best is not None:
            out.append(best)
    return out


def _speculative(model, share, hw, context, rows, spec, fixed, dtype_bytes, tp, table) -> BatchPrediction | None:
    tier0 = spec.method == "triforce"
    measured = measured_acceptance(table, spec.sparse_policy).get((spec.budget, spec.chunk_size))
    if tier0:
        acceptance = AUTO_ASSUMED if measured is None else replace(AUTO_ASSUMED, full=measured)
    else:
        acceptance = Acceptance(SELF_ASSUMED[spec.method] if measured is None else measured, 0.0)
    widest = replace(spec, gamma2=max(GAMMA2_RANGE) if "gamma2" not in fixed else spec.gamma2)
    plan = plan_memory(model, share, context, widest, dtype_bytes=dtype_bytes, tp=tp, has_tier0=tier0)
    if not plan.feasible:
        return None
    g1_range = (spec.gamma1,) if "gamma1" in fixed or not tier0 else GAMMA1_RANGE
    g2_range = (spec.gamma2,) if "gamma2" in fixed else GAMMA2_RANGE
    costs = plan.step_costs
    g1, g2, ms = best_gammas(costs, hw, acceptance, tier0, g1_range, g2_range, rows)
    decode = full_verify_ms(costs, hw, 1, rows)
    return BatchPrediction(spec.method, rows, ms, spec.budget, g2, g1 if tier0 else None, acceptance.full,
                           round(tier1_ms(costs, hw, 1, rows) / decode, 3),
                           round(full_verify_ms(costs, hw, g2 + 1, rows) / decode, 3))


@dataclass(frozen=True)
class BatchChoice:
    chosen: BatchPrediction
    predictions: list[BatchPrediction]

    def to_json(self) -> dict:
        return {"method": self.chosen.method, "margin": AUTO_MARGIN,
                "predictions": [p.to_json() for p in self.predictions]}

    def describe(self) -> str:
        ar = next((p for p in self.predictions if p.method == "ar"), None)
        ratio = f" (predicted {ar.ms_per_token / self.chosen.ms_per_token:.2f}x of ar)" if ar else ""
        return f"method auto for a batch of {self.chosen.rows}: {self.chosen.method}{ratio}"


def choose_for_batch(predictions: list[BatchPrediction]) -> BatchChoice:
    """The fastest prediction, taken over ar only with AUTO_MARGIN to spare (as --method auto)."""
    if not predictions:
        raise ValueError("no method fits")
    fastest = min(predictions, key=lambda p: p.ms_per_token)
    ar = next((p for p in predictions if p.method == "ar"), None)
    if ar is not None and ar.ms_per_token < AUTO_MARGIN * fastest.ms_per_token:
        fastest = ar
    return BatchChoice(fastest, predictions)


def spec_for(prediction: BatchPrediction, spec, fixed: frozenset[str]):
    """(spec, fixed): the spec that runs a prediction's method with its budget and gammas, and
    the flags to hold as given (the plan must not choose them again)."""
    changes = {"method": prediction.method}
    for name in ("budget", "gamma1", "gamma2"):
        if getattr(prediction, name) is not None:
            changes[name] = getattr(prediction, name)
    if prediction.gamma2 is not None:
        changes.update(gamma2_min=prediction.gamma2, gamma2_max=prediction.gamma2)
    held = {name for name in ("budget", "gamma1", "gamma2") if name in changes}
    return replace(spec, **changes), fixed | held | ({"chunk_size"} if held else set())
