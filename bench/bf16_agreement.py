"""How often speculative decoding in bfloat16 gives plain greedy decoding's tokens, and why not.

In float32/float64 greedy speculative decoding equals AR token for token (the tests check it). In
bfloat16 a verify pass computes several tokens' logits in one batched pass, whose rounding
differs from one-token steps, so where AR's top two logits are within that rounding the two can
pick different tokens (a near-tie) and the texts part there. This script counts it:

    python -m triforce.bench.bf16_agreement --prompts 20 --new-tokens 64

For each prompt (prose from Python's standard library documentation, a different passage each)
it decodes with `--method ar` and with each speculative method, all in bfloat16, and reports the
prompts whose tokens are identical; for the others, where they part and AR's top-2 logit margin
at that step (in float32 the same margin is what bfloat16 rounding can flip)."""
from __future__ import annotations

import json

import click
import torch


def greedy(lm, spec, ids, new_tokens):
    from triforce.config import SamplingParams
    from triforce.decoding.engine import Engine

    engine = Engine(lm, spec, len(ids) + new_tokens + 1, draft="lookup")
    engine.set_sequence(ids)
    return engine.generate(new_tokens, SamplingParams()).tokens


def top2_margin(lm, ids: list[int]) -> float:
    """AR's top-1 minus top-2 logit for the token after `ids` (a one-token step, as AR takes it)."""
    from triforce.cache.resident import ResidentKVCache

    cache = ResidentKVCache(lm.config, len(ids), dtype=lm.dtype)
    step = cache.step(len(ids))
    logits = lm.model(torch.tensor([ids]), step.positions, step, num_logits=1)[0, -1].float()
    top = torch.topk(logits, 2).values
    return float(top[0] - top[1])


@click.command()
@click.option("--model", default="default", show_default=True)
@click.option("--prompts", type=click.IntRange(1, 200), default=20, show_default=True)
@click.option("--prompt-tokens", type=click.IntRange(16, 8000), default=512, show_default=True)
@click.option("--new-tokens", type=click.IntRange(1, 1024), default=64, show_default=True)
@click.option("--methods", default="triforce,retrieval", show_default=True)
@click.option("--json", "as_json", is_flag=True)
def main(model, prompts, prompt_tokens, new_tokens, methods, as_json):
    from triforce.app.texts import stdlib_prose
    from triforce.config import SpecParams
    from triforce.model.loading import load_model

    lm = load_model(model, dtype="bfloat16", device="cpu")
    words = stdlib_prose().split()
    spec = dict(budget=256, chunk_size=8, gamma1=3, gamma2=6)
    rows = []
    for i in range(prompts):
        start = (i * len(words)) // prompts
        text = " ".join(words[start:start + prompt_tokens])
        ids = lm.tokenizer(text, add_special_tokens=False).input_ids[:prompt_tokens]
        ar = greedy(lm, SpecParams(method="ar"), ids, new_tokens)
        for method in methods.split(","):
            got = greedy(lm, SpecParams(method=method, **spec), ids, new_tokens)
            part = next((j for j, (a, b) in enumerate(zip(ar, got)) if a != b), None)
            row = {"prompt": i, "method": method, "identical": got == ar, "parts_at": part}
            if part is not None:
                row["ar_top2_margin"] = round(top2_margin(lm, ids + ar[:part]), 4)
            rows.append(row)
            if not as_json:
                print(json.dumps(row), flush=True)
    summary = {m: f"{sum(r['identical'] for r in rows if r['method'] == m)}/{prompts}" for m in methods.split(",")}
    margins = [r["ar_top2_margin"] for r in rows if "ar_top2_margin" in r]
    out = {"model": str(lm.path), "dtype": "bfloat16", "prompts": prompts, "prompt_tokens": prompt_tokens,
           "new_tokens": new_tokens, "identical": summary, "margins_where_parted": margins, "rows": rows}
    if as_json:
        print(json.dumps(out))
    else:
        print(f"identical to AR (of {prompts} prompts, {new_tokens} tokens each): {summary}; "
              f"AR's top-2 logit margin where they parted: {margins}")


if __name__ == "__main__":
    main()
