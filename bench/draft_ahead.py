"""How often the drafts made during a verify are kept, on the default model and natural text, and
what drafting ahead costs where nothing runs beside the verify (a CPU).

    python -m triforce.bench.draft_ahead [--prompt-tokens 8000] [--new-tokens 128] [--temperatures 0,0.7]

One prefill of a natural-text prompt (text that never repeats itself), then triforce (lookup ->
retrieval -> full, the GPU campaign's tiers) decodes with drafting ahead on and off, in turns,
at each temperature: the verifies drafted ahead of, the share of them whose drafts the next
cycle took, tokens per full verify, whether the greedy tokens are equal, and the time ratio. On
a CPU the drafting runs after the verify, so every dropped cycle's drafting is pure cost; on a
GPU it runs while the verify's copies stream (offload.cost_model drafted_ahead_ms_per_token
predicts that, with the kept share as `full_rate ** (gamma2 + 1)`, printed beside the measured
one)."""
from __future__ import annotations

import json
import platform
import sys
import time

import click
import torch

from triforce.app.texts import prompt_text
from triforce.config import SamplingParams, SpecParams
from triforce.decoding.engine import Engine
from triforce.model.loading import load_model


def decode(lm, spec: SpecParams, ids: list[int], new_tokens: int, params: SamplingParams, cache, ahead: bool):
    engine = Engine(lm, spec, len(ids) + new_tokens + 1, "lookup", kv_cache=cache, draft_ahead=ahead)
    if cache is not None:
        engine.full.adopt(ids[:-1])
    engine.set_sequence(ids)
    generator = torch.Generator().manual_seed(params.seed or 0)
    return engine, engine.generate(new_tokens, params, frozenset(), generator=generator)


def measure(lm, ids: list[int], new_tokens: int, temperatures: list[float], rounds: int) -> list[dict]:
    spec = SpecParams(method="triforce", budget=1024, gamma1=4, gamma2=8)
    cache, rows = None, []
    for temperature in temperatures:
        params = SamplingParams(temperature=temperature, seed=1)
        runs: dict[str, list] = {"on": [], "off": []}
        for _ in range(rounds):
            for ahead in ("off", "on"):
                engine, result = decode(lm, spec, ids, new_tokens, params, cache, ahead == "on")
                cache = engine.full.cache
                runs[ahead].append(result)
                print(f"T={temperature} draft ahead {ahead}: {len(result.tokens) / result.time_s:.2f} tok/s",
                      file=sys.stderr)
        on, off = runs["on"], runs["off"]
        verifies = sum(r.stats["draft_ahead_rounds"] for r in on)
        kept = sum(r.stats["draft_ahead_kept"] for r in on)
        full = [r.stats["acceptance_rates"].get("full") for r in off]
        rows.append({
            "temperature": temperature, "verifies_drafted_ahead": verifies, "kept": kept,
            "kept_share": round(kept / verifies, 3) if verifies else None,
            "full_acceptance_off": full[0],
            "tokens_per_full_verify": {"off": off[0].stats["mean_tokens_per_full_verify"],
                                       "on": on[0].stats["mean_tokens_per_full_verify"]},
            "cpu_time_on_over_off": round(sum(r.time_s for r in on) / sum(r.time_s for r in off), 3),
            "same_tokens": all(a.tokens == b.tokens for a, b in zip(on, off)) if temperature == 0 else None,
        })
    return rows


@click.command()
@click.option("--prompt-tokens", type=int, default=8000, show_default=True)
@click.option("--new-tokens", type=int, default=128, show_default=True)
@click.option("--temperatures", default="0,0.7", show_default=True)
@click.option("--rounds", type=click.IntRange(1, 10), default=2, show_default=True,
              help="Turns of on and off after the one prefill (the time ratio sums them).")
def main(prompt_tokens: int, new_tokens: int, temperatures: str, rounds: int) -> None:
    lm = load_model("default", dtype="float32", device="cpu")
    from triforce.kernels.cpu import warm
    warm.warm_up(lm.dtype, [(lm.config.num_kv_heads, lm.config.head_dim)])
    ids = lm.tokenizer(prompt_text("natural", lm.tokenizer, prompt_tokens)).input_ids[:prompt_tokens]
    started = time.perf_counter()
    rows = measure(lm, ids, new_tokens, [float(t) for t in temperatures.split(",")], rounds)
    print(json.dumps({"machine": f"{platform.machine()} {torch.get_num_threads()} threads, torch {torch.__version__}",
                      "prompt_tokens": len(ids), "new_tokens": new_tokens, "rounds": rounds,
                      "seconds": round(time.perf_counter() - started), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
