"""Speculation on CPU with the default model: the paper's Table 1 in miniature (how well each
sparse cache stands in for the full cache) and decode speed of every method against `ar`.

    python -m triforce.bench.speculation_cpu --table --speed
"""
from __future__ import annotations

import json
import platform
import statistics
import sys
import time

import click
import torch

from triforce.app.evaluation import evaluate_acceptance, needle_prompt
from triforce.app.texts import prompt_text
from triforce.config import SamplingParams, SpecParams
from triforce.decoding.engine import Engine
from triforce.model.context_stretch import KINDS, stretch_request
from triforce.model.loading import load_model


def acceptance_table(lm, budgets: list[int], gen: int) -> list[dict]:

    prompts = {
        "needle ~6K": lm.tokenizer(needle_prompt(lm.tokenizer, 6000, depth=0.5).text).input_ids,
        "natural ~7K": lm.tokenizer(prompt_text("natural", lm.tokenizer, 7000)).input_ids,
        "repeated ~7K (best case)": lm.tokenizer(prompt_text("repeated", lm.tokenizer, 7000)).input_ids,
    }
    rows = []
    for name, ids in prompts.items():
        started = time.perf_counter()
        results = evaluate_acceptance(lm, ids, budgets, ["streaming", "retrieval", "topk"], gen)
        print(f"{name}: {len(ids)} tokens scored in {time.perf_counter() - started:.0f} s", file=sys.stderr)
        rows += [{"prompt": name, "prompt_tokens": len(ids), **r} for r in results]
    return rows


def method_speed(lm, prompt_tokens: int, new_tokens: int, budget: int,
                 methods=("ar", "triforce", "retrieval", "streaming", "naive"), kinds=("natural", "needle"),
                 rounds: int = 1) -> list[dict]:
    """Decode speed of each method after the same prompt; the prompt is prefilled once and its
    cache handed from method to method (a 32K-token prefill takes minutes on two cores). With
    rounds > 1 the methods take turns that many times: a method's speed is its best round and
    its speed-up the median over rounds of ar's time in that round over its own, so a noisy
    neighbour that slows one round slows both sides of that round's ratio."""
    prompts = {
        "natural": lambda: lm.tokenizer(prompt_text("natural", lm.tokenizer, prompt_tokens)).input_ids,
        "repeated": lambda: lm.tokenizer(prompt_text("repeated", lm.tokenizer, prompt_tokens)).input_ids,
        "needle": lambda: lm.tokenizer(needle_prompt(lm.tokenizer, prompt_tokens).text).input_ids,
    }
    if lm.device.type == "cpu":  # compile the decode kernels now: on an empty cache the first round timed numba
        from triforce.kernels.cpu import warm
        warm.warm_up(lm.dtype, [(lm.config.num_kv_heads, lm.config.head_dim)])
    rows = []
    for name in kinds:
        ids = prompts[name]()[:prompt_tokens]
        cache, runs = None, {}
        for _ in range(rounds):
            for method in methods:
                spec = SpecParams(method=method, budget=budget)
                engine = Engine(lm, spec, len(ids) + new_tokens, "lookup" if spec.uses_draft else None, kv_cache=cache)
                if cache is not None:
                    engine.full.adopt(ids[:-1])
                started = time.perf_counter()
                engine.set_sequence(ids)
                if cache is None:
                    print(f"{name}: {len(ids)} tokens prefilled in {time.perf_counter() - started:.0f} s",
                          file=sys.stderr)
                cache = engine.full.cache
                result = engine.generate(new_tokens, SamplingParams(), frozenset())
                runs.setdefault(method, []).append((result, engine.describe()))
                print(f"{name} {method}: {len(result.tokens) / result.time_s:.2f} tok/s", file=sys.stderr)
        # each round against the same round's first method: a method that hands the cache on may
        # have re-run the prompt's last token through the decoding kernels (bfloat16 bits differ
        # from the prefill's), so later rounds start from a cache that is not bit for bit the first's
        reference = [r for r, _ in runs[methods[0]]]
        ar_times = [r.time_s for r in reference]
        for method in methods:
            results = [r for r, _ in runs[method]]
            first = results[0]
            rows.append({
                "prompt": name, "prompt_tokens": len(ids), "method": method, "tiers": runs[method][0][1],
                "decode_tok_s": round(max(len(r.tokens) / r.time_s for r in results), 2),
                "decode_tok_s_rounds": [round(len(r.tokens) / r.time_s, 2) for r in results],
                "speedup_vs_ar": round(statistics.median(a / r.time_s for a, r in zip(ar_times, results)), 2),
                "mean_tokens_per_full_verify": first.stats["mean_tokens_per_full_verify"],
                "acceptance_rates": first.stats["acceptance_rates"],
                # the first round's seconds in each tier's own passes (they add up to about its time)
                "tier_time_s": first.stats["tier_time_s"], "full_verifies": first.stats["full_verifies"],
                "same_tokens_as_ar": all(r.tokens == a.tokens for r, a in zip(results, reference)),
                "same_tokens_as_ar_rounds": [r.tokens == a.tokens for r, a in zip(results, reference)],
            })
    return rows


@click.command()
@click.option("--table/--no-table", default=True, help="Acceptance of each sparse cache policy.")
@click.option("--speed/--no-speed", default=True, help="Decode speed of each method.")
@click.option("--budgets", default="256,512,1024", show_default=True)
@click.option("--gen", type=int, default=64, show_default=True, help="Continuation tokens scored.")
@click.option("--prompt-tokens", type=int, default=8000, show_default=True, help="Prompt length for --speed.")
@click.option("--new-tokens", type=int, default=64, show_default=True)
@click.option("--budget", type=int, default=1024, show_default=True, help="Sparse cache budget for --speed.")
@click.option("--methods", default="ar,triforce,retrieval,streaming,naive", show_default=True,
              help="Methods timed by --speed (ar first: the others are compared with it).")
@click.option("--prompts", default="natural,needle", show_default=True,
              help="Prompt kinds timed by --speed: natural (text that never repeats itself), needle (a pass key "
                   "in natural text), repeated (the corpus doubled to length: a stated best case).")
@click.option("--dtype", default="float32", show_default=True)
@click.option("--max-context", type=int, default=None, help="With --rope-scaling: stretch the model this far.")
@click.option("--rope-scaling", type=click.Choice(KINDS), default=None)
@click.option("--rounds", type=click.IntRange(1, 20), default=1, show_default=True,
              help="--speed: the methods take turns this many times after the one prefill (speed-up: the "
                   "median of the rounds' ratios; the first method is the reference).")
def main(table, speed, budgets, gen, prompt_tokens, new_tokens, budget, methods, prompts, dtype, max_context,
         rope_scaling, rounds):

    stretch = stretch_request(max_context, rope_scaling)
    lm = load_model("default", dtype=dtype, device="cpu", rope_scaling=stretch)
    out = {"machine": f"{platform.machine()} {torch.get_num_threads()} threads, torch {torch.__version__}",
           "dtype": dtype, "rope_scaling": stretch}
    if table:
        out["acceptance"] = acceptance_table(lm, [int(b) for b in budgets.split(",")], gen)
    if speed:
        out["speed"] = method_speed(lm, prompt_tokens, new_tokens, budget, methods.split(","), prompts.split(","),
                                    rounds)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
