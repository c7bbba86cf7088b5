"""How often to rebuild the retrieval cache: decode speed and acceptance of `triforce` over
rebuild strides and rolling-acceptance thresholds (CPU, default model, one prefill per prompt).

    python -m triforce.bench.rebuild_sweep --strides 64,128,256,512 --thresholds 0.3,0.5,0.7
"""
from __future__ import annotations

import json
import sys
from dataclasses import replace

import click

from triforce.app.evaluation import needle_prompt
from triforce.app.texts import prompt_text
from triforce.config import SamplingParams, SpecParams
from triforce.decoding.engine import Engine
from triforce.model.loading import load_model


@click.command()
@click.option("--strides", default="64,128,256,512", show_default=True)
@click.option("--thresholds", default="0.3,0.5,0.7", show_default=True)
@click.option("--prompt-tokens", type=int, default=8000, show_default=True)
@click.option("--new-tokens", type=int, default=128, show_default=True)
@click.option("--budget", type=int, default=1024, show_default=True)
def main(strides, thresholds, prompt_tokens, new_tokens, budget):
    lm = load_model("default", dtype="float32", device="cpu")
    stride_list = [int(s) for s in strides.split(",")]
    prompts = {"needle": lm.tokenizer(needle_prompt(lm.tokenizer, prompt_tokens).text).input_ids,
               "natural": lm.tokenizer(prompt_text("natural", lm.tokenizer, prompt_tokens)).input_ids}
    rows = []
    for name, ids in prompts.items():
        widest = SpecParams(method="triforce", budget=budget, rebuild_stride=max(stride_list))
        engine = Engine(lm, widest, len(ids) + new_tokens, "lookup")  # one prefill, reused below
        for stride in stride_list:
            for threshold in (float(t) for t in thresholds.split(",")):
                engine.spec = replace(widest, rebuild_stride=stride, rebuild_threshold=threshold)
                engine.set_sequence(ids)
                result = engine.generate(new_tokens, SamplingParams(), frozenset())
                rows.append({"prompt": name, "stride": stride, "threshold": threshold,
                             "decode_tok_s": round(len(result.tokens) / result.time_s, 2),
                             "mean_tokens_per_full_verify": result.stats["mean_tokens_per_full_verify"],
                             "acceptance": result.stats["acceptance_rates"],
                             "rebuilds": result.stats["rebuilds"]})
                print(rows[-1], file=sys.stderr)
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
