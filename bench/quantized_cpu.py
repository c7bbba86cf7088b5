"""Decoding the default model with its weights as GGUF blocks against float32, side by side (CPU).

    python -m triforce.bench.quantized_cpu [--contexts 2048,6144] [--new-tokens 64] [--rounds 2]

For each context: one natural-text prompt, `ar` greedy with the weights as float32 (de-quantized
once, today's default), as the file's own blocks (`--quantize gguf`: Q4_1 projections, Q8_0
embeddings and head) and re-quantized to Q8_0 (`--quantize q8_0`); decode tok/s (best of the
rounds, each after a warm-up), prefill tok/s, weight bytes, and whether the greedy tokens equal
float32's (they need not: the weights differ by rounding only in the q8_0 row, and float order
differs in all)."""
from __future__ import annotations

import json
import platform
import time

import click
import torch

from triforce.app.texts import prompt_text
from triforce.config import SamplingParams, SpecParams
from triforce.decoding.engine import Engine
from triforce.model.loading import load_model

KINDS = (None, "gguf", "q8_0")


def weight_bytes(lm) -> int:
    if lm.quantized is not None:
        floats = sum(p.numel() * p.element_size() for p in lm.model.parameters())  # norms (and biases)
        return lm.quantized["bytes"] + floats
    return sum(p.numel() * p.element_size() for p in lm.model.parameters())


def run(contexts: list[int], new_tokens: int, rounds: int) -> list[dict]:
    from triforce.kernels.cpu import warm

    rows = []
    for kind in KINDS:
        lm = load_model("default", dtype="float32", device="cpu", quantize=kind)
        warm.warm_up(lm.dtype, [(lm.config.num_kv_heads, lm.config.head_dim)])
        for context in contexts:
            ids = lm.tokenizer(prompt_text("natural", lm.tokenizer, context)).input_ids[:context]
            engine = Engine(lm, SpecParams(method="ar"), len(ids) + new_tokens + 1)
            started = time.perf_counter()
            engine.set_sequence(ids)
            prefill_s = time.perf_counter() - started
            engine.generate(4, SamplingParams())  # warm-up
            results = []
            for _ in range(rounds):
                engine.set_sequence(ids)
                results.append(engine.generate(new_tokens, SamplingParams()))
            rows.append({"weights": kind or "float32", "context": len(ids),
                         "decode_tok_s": round(max(len(r.tokens) / r.time_s for r in results), 2),
                         "prefill_tok_s": round(len(ids) / prefill_s, 1), "weight_bytes": weight_bytes(lm),
                         "file_bytes": lm.quantized["file_bytes"] if lm.quantized else None,
                         "tokens": results[0].tokens})
    reference = {r["context"]: r["tokens"] for r in rows if r["weights"] == "float32"}
    for r in rows:
        r["same_tokens_as_float32"] = r.pop("tokens") == reference[r["context"]]
    return rows


@click.command()
@click.option("--contexts", default="2048,6144", show_default=True)
@click.option("--new-tokens", type=int, default=64, show_default=True)
@click.option("--rounds", type=click.IntRange(1, 10), default=2, show_default=True)
def main(contexts: str, new_tokens: int, rounds: int) -> None:
    rows = run([int(c) for c in contexts.split(",")], new_tokens, rounds)
    print(json.dumps({"machine": f"{platform.machine()} {torch.get_num_threads()} threads, torch {torch.__version__}",
                      "new_tokens": new_tokens, "rounds": rounds, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
