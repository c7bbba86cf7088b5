"""Tokens/s of triforce's AR decoding against transformers' own `generate`, same model, prompt
and settings, in one run; and the timed decodes the llama.cpp comparison uses too.

    triforce bench transformers --contexts 2048,8064 --new-tokens 64
"""
from __future__ import annotations

import json
import platform
import statistics
import sys
import time

import click
import torch

from triforce.bench.harness import emit, output_option


class _Clock:
    """A transformers streamer that only timestamps: the first put() is the prompt."""

    def __init__(self):
        self.times: list[float] = []

    def put(self, value):
        self.times.append(time.perf_counter())

    def end(self):
        pass


def time_transformers(hf_model, ids: list[int], new_tokens: int) -> dict:
    clock = _Clock()
    started = time.perf_counter()
    with torch.inference_mode():
        out = hf_model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False,
                                eos_token_id=None, pad_token_id=0, streamer=clock)
    total = time.perf_counter() - started
    # times[1] is the first new token (after prefill); the rest are decode steps
    decode_s = clock.times[-1] - clock.times[1]
    return {"tokens": out[0, len(ids):].tolist(), "total_s": total,
            "prefill_s": clock.times[1] - started, "decode_tokens_per_s": (new_tokens - 1) / decode_s}


def time_triforce(lm, ids: list[int], new_tokens: int) -> dict:
    from triforce.config import SamplingParams, SpecParams
    from triforce.decoding.engine import Engine

    stamps: list[float] = []
    started = time.perf_counter()
    engine = Engine(lm, SpecParams(method="ar"), len(ids) + new_tokens)
    engine.set_sequence(ids)
    result = engine.generate(new_tokens, SamplingParams(), frozenset(),
                             on_token=lambda _: stamps.append(time.perf_counter()))
    total = time.perf_counter() - started
    decode_s = stamps[-1] - stamps[0]
    return {"tokens": result.tokens, "total_s": total, "prefill_s": stamps[0] - started,
            "decode_tokens_per_s": (new_tokens - 1) / decode_s}


def prompt_ids(tokenizer, kind: str, tokens: int) -> list[int]:
    """The first `tokens` ids of a natural, repeated or needle prompt."""
    from triforce.app.evaluation import needle_prompt
    from triforce.app.texts import prompt_text

    text = needle_prompt(tokenizer, tokens).text if kind == "needle" else prompt_text(kind, tokenizer, tokens)
    return tokenizer(text).input_ids[:tokens]


def method_speed(lm, prompt_tokens: int, new_tokens: int, budget: int,
                 methods=("ar", "triforce", "retrieval", "streaming", "naive"), kinds=("natural", "needle"),
                 rounds: int = 1) -> list[dict]:
    """Decode speed of each method after the same prompt; the prompt is prefilled once and its
    cache handed from method to method (a 32K-token prefill takes minutes on two cores). With
    rounds > 1 the methods take turns that many times: a method's speed is its best round and
    its speed-up the median over rounds of ar's time in that round over its own, so a noisy
    neighbour that slows one round slows both sides of that round's ratio."""
    from triforce.config import SamplingParams, SpecParams
    from triforce.decoding.engine import Engine

    if lm.device.type == "cpu":  # compile the decode kernels now: on an empty cache the first round timed numba
        from triforce.kernels.cpu import warm
        warm.warm_up(lm.dtype, [(lm.config.num_kv_heads, lm.config.head_dim)])
    rows = []
    for name in kinds:
        ids = prompt_ids(lm.tokenizer, name, prompt_tokens)
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
@click.option("--model", default="default", show_default=True)
@click.option("--contexts", default="2048,8064", show_default=True, help="Prompt lengths in tokens.")
@click.option("--new-tokens", type=click.IntRange(2, 4096), default=64, show_default=True)
@click.option("--repeats", type=click.IntRange(1, 20), default=2, show_default=True,
              help="Runs per side, taking turns; each side keeps its best.")
@output_option
def main(model, contexts, new_tokens, repeats, fmt):
    """Against transformers' generate: AR decoding of the same model, prompt and greedy tokens, float32."""
    from triforce.app.texts import natural_ids
    from triforce.model.loading import load_model, transformers_model

    lm = load_model(model, dtype="float32", device="cpu")
    hf = transformers_model(lm.path, torch.float32)
    rows = []
    for n in [int(c) for c in contexts.split(",")]:
        ids = natural_ids(lm.tokenizer, n)
        ours, theirs = [], []
        for _ in range(repeats):  # in turns: a noisy moment costs both sides
            ours.append(time_triforce(lm, ids, new_tokens))
            theirs.append(time_transformers(hf, ids, new_tokens))
        ours = max(ours, key=lambda r: r["decode_tokens_per_s"])
        theirs = max(theirs, key=lambda r: r["decode_tokens_per_s"])
        rows.append({
            "prompt_tokens": len(ids), "new_tokens": new_tokens,
            "triforce_decode_tok_s": round(ours["decode_tokens_per_s"], 2),
            "transformers_decode_tok_s": round(theirs["decode_tokens_per_s"], 2),
            "decode_speedup": round(ours["decode_tokens_per_s"] / theirs["decode_tokens_per_s"], 3),
            "triforce_end_to_end_tok_s": round(new_tokens / ours["total_s"], 2),
            "transformers_end_to_end_tok_s": round(new_tokens / theirs["total_s"], 2),
            "triforce_prefill_s": round(ours["prefill_s"], 2),
            "transformers_prefill_s": round(theirs["prefill_s"], 2),
            "same_tokens": ours["tokens"] == theirs["tokens"],
        })
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    summary = {"machine": f"{platform.machine()} {torch.get_num_threads()} threads, torch {torch.__version__}",
               "model": str(lm.path)}
    emit(fmt, summary, rows)

if __name__ == "__main__":
    main()
