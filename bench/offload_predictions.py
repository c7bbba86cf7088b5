"""Predicted, not measured: what each step of the offloading work is worth at 32K and 127K on a
24 GB card, by the cost model, before a GPU measures it.

    python -m triforce.bench.offload_predictions [--trace FILE] [--json]

Llama2-7B-128K in bfloat16 on each profile (rtx4090-24g: PCIe 4.0; h100-80g capped to 24 GB as the
GPU campaign runs it, with its nominal PCIe 5.0 link), acceptance from an acceptance trace recorded
on natural text (default: the 8K one; the 32K YaRN trace shows the 135M model reciting itself, 0.97 kept). Cumulative rows:
  today            every host block over PCIe, drafting before the verify, budget and gammas of the trace
  + hybrid         the CPU attends its share of the host KV in place (offload.hybrid), the rest streams
  + residency      the prefill's scratch memory holds whole host blocks once decoding starts (built)
  + overlap        the next cycle's drafting runs while the verify's copies stream, kept when the
                   verify accepts it all and the bonus token is the guessed one (built: draft_ahead)
  + sized gamma2   gamma2 chosen by the cost model for the acceptance (up to 15)
  + static tree    (with --tree-hit, not built: item 6) one alternative beside each draft, verified
                   in the same pass; --tree-hit is how often it is taken where the chain breaks
                   (measured once: bench/history/2026-11-26-natural-text.md)
ar-offload (the paper's baseline) and ar-hybrid (the stronger one) beside them, both without
the residency step. The profiles' CPU
rates are nominal estimates until `triforce profile tune` measures them on the machine."""
from __future__ import annotations

import json

import click

from triforce.config import SpecParams
from triforce.decoding.acceptance_trace import load_trace, trace_acceptance
from triforce.model.architectures import arch_config
from triforce.plan.cost_model import (GAMMA2_RANGE, best_gammas, costs_at, drafted_ahead_ms_per_token,
                                      full_verify_ms, static_tree_part, triforce_ms_per_token)
from triforce.plan.planner import hardware, plan_memory
from triforce.plan.profiles import load_profile

CONTEXTS = (32768, 130048)
PROFILES = (("rtx4090-24g", None), ("h100-80g", "24GB"))


def predict(profile_name: str, budget_bytes: str | None, context: int, trace: dict,
            tree_hit: float | None = None, *, model=None, dtype_bytes: int = 2, weights=None) -> dict:
    """The cost model's ms/token by step and by `bench offload` method on a profile; `model`
    (default Llama2-7B-128K), `dtype_bytes` and `weights` (block-quantized ones) as a run has them."""
    from triforce.plan.profiles import parse_size

    profile = load_profile(profile_name)
    if budget_bytes:
        profile = profile.with_device_budget(parse_size(budget_bytes))
    model = model or arch_config("llama2-7b-128k")
    acceptance = trace_acceptance(trace)
    spec = SpecParams(method="triforce", budget=int(trace.get("budget", 1024)), gamma1=int(trace.get("gamma1", 4)),
                      gamma2=int(trace.get("gamma2", 8)), chunk_size=int(trace.get("chunk_size", 8)))
    plan = plan_memory(model, profile, context, spec, dtype_bytes=dtype_bytes, acceptance=acceptance, has_tier0=True,
                       weights=weights)
    if not plan.feasible:
        return {"profile": profile.name, "context": context, "error": plan.reason}
    costs = plan.step_costs
    streamed, hybrid = hardware(profile, dtype_bytes, hybrid=False), hardware(profile, dtype_bytes)

    def tri(c, hw, g2=spec.gamma2, overlap=False, hit=None) -> float:
        part = triforce_ms_per_token(c, hw, acceptance, spec.gamma1, g2, has_tier0=True)
        if hit is not None:
            part = static_tree_part(c, hw, part, acceptance.full, g2, hit)
        if not overlap:
            return part["triforce_ms_per_token"]
        return drafted_ahead_ms_per_token(part, acceptance.full, g2)["ms_per_token"]

    resident = plan.decode_resident_tokens  # the plan's costs already count the blocks moved after prefill
    before = costs_at(costs, plan.resident_tokens, context)  # as if nothing moved
    best_g2 = best_gammas(costs, hybrid, acceptance, True, (spec.gamma1,), GAMMA2_RANGE)[1]
    rows = {
        "ar-offload": full_verify_ms(before, streamed, 1),
        "ar-hybrid": full_verify_ms(before, hybrid, 1),
        "today": tri(before, streamed),
        "+ hybrid": tri(before, hybrid),
        "+ residency": tri(costs, hybrid),
        "+ overlap": tri(costs, hybrid, overlap=True),
        "+ sized gamma2": tri(costs, hybrid, g2=best_g2, overlap=True),
    }
    if tree_hit is not None:
        rows["+ static tree"] = tri(costs, hybrid, g2=best_g2, overlap=True, hit=tree_hit)
    # the same by `bench offload` method (its triforce rows: hybrid and residency on, ahead off)
    by_method = {"ar-offload": rows["ar-offload"], "ar-hybrid": rows["ar-hybrid"], "triforce": rows["+ residency"],
                 "triforce-ahead": rows["+ overlap"], "triforce-no-hybrid": tri(costs, streamed),
                 "triforce-no-residency": rows["+ hybrid"]}
    return {"profile": profile.name, "context": context, "resident_tokens": plan.resident_tokens,
            "by_method": {k: round(v, 3) for k, v in by_method.items()}, "gamma2": spec.gamma2,
            "host_kv_bytes": plan.host_kv_bytes, "prefill_group": plan.prefill_group, "costs": costs,
            "resident_after_prefill": resident, "gamma2_sized": best_g2,
            "drafted_ahead_kept_share": round(acceptance.full ** (spec.gamma2 + 1), 3),
            "acceptance": {"full": acceptance.full, "retrieval": acceptance.retrieval},
            "host_attention": [profile.host_attention_gbps, profile.host_attention_tflops],
            "pcie_gbps": profile.pcie_h2d_gbps, "ms_per_token": {k: round(v, 1) for k, v in rows.items()}}


@click.command()
@click.option("--trace", "trace_path", default="bench/traces/smollm2-natural8k-triforce-lookup.json",
              show_default=True, help="Acceptance trace the predictions take their acceptance from.")
@click.option("--tree-hit", type=click.FloatRange(0, 1), default=None,
              help="Add the static-tree row: how often the alternative is taken where the chain breaks.")
@click.option("--json", "as_json", is_flag=True)
def main(trace_path: str, tree_hit: float | None, as_json: bool) -> None:
    """Print the predicted ms/token of each step (see the module docstring)."""
    trace = load_trace(trace_path)
    results = [predict(name, budget, context, trace, tree_hit) for name, budget in PROFILES for context in CONTEXTS]
    if as_json:
        print(json.dumps({"trace": trace_path, "results": [{k: v for k, v in r.items() if k != "costs"}
                                                            for r in results]}))
        return
    acc = trace_acceptance(trace)
    print(f"Predicted (cost model), Llama2-7B-128K bf16, acceptance from {trace_path}: full {acc.full} per token, "
          f"retrieval {acc.retrieval:.2f} kept\n")
    keys = list(next(r for r in results if "error" not in r)["ms_per_token"])
    print("| profile | context | " + " | ".join(f"predicted {k} ms/token" for k in keys) + " |")
    print("|---|---:|" + "---:|" * len(keys))
    for r in results:
        if "error" in r:
            print(f"| {r['profile']} | {r['context']} | does not fit: {r['error']} |")
            continue
        cells = [f"{v:.1f}" for v in r["ms_per_token"].values()]
        print(f"| {r['profile']} | {r['context']} | " + " | ".join(cells) + " |")
    for r in results:
        if "error" not in r:
            print(f"- {r['profile']} {r['context']}: resident {r['resident_tokens']} -> {r['resident_after_prefill']} "
                  f"tokens after prefill, gamma2 sized {r['gamma2_sized']}, drafts kept from drafting ahead "
                  f"{r['drafted_ahead_kept_share']:.0%}, CPU rates {r['host_attention']} "
                  f"(GB/s, TFLOP/s), PCIe {r['pcie_gbps']} GB/s")


if __name__ == "__main__":
    main()
