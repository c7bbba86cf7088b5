"""Tokens/s of triforce's AR decoding against transformers' own `generate`, same model, prompt
and settings, in one run.

    python -m triforce.bench.ar_vs_transformers --contexts 2048,8064 --new-tokens 64
"""
from __future__ import annotations

import json
import platform
import time

import click
import torch


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


@click.command()
@click.option("--model", default="default", show_default=True)
@click.option("--contexts", default="2048,8064", show_default=True, help="Prompt lengths in tokens.")
@click.option("--new-tokens", type=int, default=64, show_default=True)
@click.option("--repeats", type=int, default=2, show_default=True, help="Best of N runs per side.")
@click.option("--json", "as_json", is_flag=True)
def main(model, contexts, new_tokens, repeats, as_json):
    from transformers import AutoModelForCausalLM

    from triforce.model.loading import load_model
    from triforce.app.texts import natural_ids

    lm = load_model(model, dtype="float32", device="cpu")
    hf = AutoModelForCausalLM.from_pretrained(str(lm.path), dtype=torch.float32).eval()
    rows = []
    for n in [int(c) for c in contexts.split(",")]:
        ids = natural_ids(lm.tokenizer, n)
        ours = max((time_triforce(lm, ids, new_tokens) for _ in range(repeats)),
                   key=lambda r: r["decode_tokens_per_s"])
        theirs = max((time_transformers(hf, ids, new_tokens) for _ in range(repeats)),
                     key=lambda r: r["decode_tokens_per_s"])
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
    info = {"machine": f"{platform.machine()} {torch.get_num_threads()} threads, torch {torch.__version__}",
            "model": str(lm.path), "rows": rows}
    if as_json:
        print(json.dumps(info))
        return
    print(info["machine"])
    header = ("prompt", "ours tok/s", "hf tok/s", "speedup", "ours e2e", "hf e2e", "ours prefill s",
              "hf prefill s", "same tokens")
    print(" | ".join(header))
    for r in rows:
        print(" | ".join(str(v) for v in (r["prompt_tokens"], r["triforce_decode_tok_s"],
                                          r["transformers_decode_tok_s"], r["decode_speedup"],
                                          r["triforce_end_to_end_tok_s"], r["transformers_end_to_end_tok_s"],
                                          r["triforce_prefill_s"], r["transformers_prefill_s"],
                                          r["same_tokens"])))


if __name__ == "__main__":
    main()
