"""The cost model against measurement: predicted and measured ms/token of `ar` and two-tier
`triforce` (retrieval -> full) on the default model, with a measured profile. The triforce
prediction uses the run's own mean tokens per full verify, so it checks the step-time model, not
the acceptance model.

    triforce profile tune --out mine.toml
    python -m triforce.bench.cost_model_check --profile mine.toml --contexts 2048,8000
"""
from __future__ import annotations

import json
import sys

import click
import torch

from triforce.app.plan_and_cache import make_plan
from triforce.app.texts import prompt_text
from triforce.config import SamplingParams, SpecParams
from triforce.decoding.engine import Engine
from triforce.model.loading import load_model
from triforce.offload.cost_model import full_verify_ms, tier1_ms
from triforce.offload.planner import hardware
from triforce.offload.profiles import load_profile


def measure(lm, spec: SpecParams, ids: list[int], new_tokens: int) -> dict:
    engine = Engine(lm, spec, len(ids) + new_tokens + 8, "none" if spec.method == "triforce" else None)
    engine.set_sequence(ids)
    engine.generate(4, SamplingParams(), frozenset())  # warm-up
    result = engine.generate(new_tokens, SamplingParams(), frozenset())
    return {"ms_per_token": 1000 * result.time_s / len(result.tokens),
            "tokens_per_verify": result.stats["mean_tokens_per_full_verify"]}


@click.command()
@click.option("--profile", "profile_path", required=True, help="A measured profile (triforce profile tune).")
@click.option("--contexts", default="2048,8000", show_default=True)
@click.option("--new-tokens", type=int, default=48, show_default=True)
@click.option("--budget", type=int, default=512, show_default=True)
@click.option("--gamma2", type=int, default=6, show_default=True)
@click.option("--prompt", "prompt_kind", type=click.Choice(["natural", "repeated"]), default="natural",
              show_default=True, help="natural: text that never repeats itself (what users bring); repeated: "
                                      "the corpus doubled to length, a stated best case for speculation.")
def main(profile_path, contexts, new_tokens, budget, gamma2, prompt_kind):
    profile = load_profile(profile_path)
    hw = hardware(profile)
    lm = load_model("default", dtype="float32", device="cpu")
    rows = []
    for context in (int(c) for c in contexts.split(",")):
        ids = lm.tokenizer(prompt_text(prompt_kind, lm.tokenizer, context)).input_ids[:context]
        ar_spec = SpecParams(method="ar")
        tri_spec = SpecParams(method="triforce", budget=budget, gamma2=gamma2)
        costs = make_plan(lm.config, profile, len(ids) + new_tokens, tri_spec, lm.dtype).step_costs
        ar = measure(lm, ar_spec, ids, new_tokens)
        tri = measure(lm, tri_spec, ids, new_tokens)
        predicted_ar = full_verify_ms(costs, hw, 1)
        predicted_tri = (full_verify_ms(costs, hw, gamma2 + 1) + gamma2 * tier1_ms(costs, hw, 1)) \
            / tri["tokens_per_verify"]
        for method, measured, predicted in (("ar", ar["ms_per_token"], predicted_ar),
                                            ("triforce (retrieval -> full)", tri["ms_per_token"], predicted_tri)):
            rows.append({"context": len(ids), "method": method, "measured_ms": round(measured, 2),
                         "predicted_ms": round(predicted, 2),
                         "error": round(predicted / measured - 1, 3)})
            print(rows[-1], file=sys.stderr)
    print(json.dumps({"profile": profile.name, "threads": torch.get_num_threads(), "budget": budget,
                      "gamma2": gamma2, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
