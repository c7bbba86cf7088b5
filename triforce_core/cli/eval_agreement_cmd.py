"""`triforce eval agreement`: where two computations of the same model part (triforce.app.agreement)."""
from __future__ import annotations

import json

import click

from triforce.cli.options import INT, model_option
from triforce.errors import UserError


@click.command("agreement")
@model_option
@click.option("--against", type=click.Choice(["bfloat16-speculation", "llamacpp"]), required=True,
              help="bfloat16-speculation: each --methods against AR, all in bfloat16, on --prompts passages of "
                   "prose; llamacpp: AR over the GGUF file's own blocks against llama.cpp's llama-completion on "
                   "ten held-out prompts (and against the same weights de-quantized).")
@click.option("--llama-completion", "binary", default=None, help="With llamacpp: the path of llama-completion.")
@click.option("--gguf", default=None, help="With llamacpp: the file both run (default: the default model's).")
@click.option("--prompts", type=click.IntRange(1, 200), default=20, show_default=True,
              help="With bfloat16-speculation: passages, each from a different place in the prose.")
@click.option("--prompt-tokens", type=click.IntRange(16, 8000), default=512, show_default=True,
              help="With bfloat16-speculation: tokens per passage.")
@click.option("--new-tokens", type=INT, default=32, show_default=True, help="Greedy tokens per prompt.")
@click.option("--methods", default="triforce,retrieval", show_default=True,
              help="With bfloat16-speculation: the speculative methods compared with AR.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of a line per prompt.")
def agreement(model, against, binary, gguf, prompts, prompt_tokens, new_tokens, methods, as_json):
    """Greedy tokens of two computations of the same model, prompt by prompt: how many agree before
    the first difference, and for bfloat16 AR's top-2 logit margin where they part (a near-tie that
    rounding flips). Reported, never a pass or fail: in float32 speculation equals AR exactly."""
    from triforce.app import agreement as a

    if new_tokens < 1:
        raise UserError("--new-tokens must be at least 1")
    on_row = None if as_json else (lambda row: print(json.dumps(row), flush=True))
    if against == "llamacpp":
        if binary is None:
            raise UserError("--against llamacpp needs --llama-completion PATH (llama.cpp's llama-completion)")
        import torch

        from triforce.model.loading import gguf_file, load_model

        gguf = gguf or str(gguf_file("default"))
        blocks = load_model(gguf, dtype="float32", device="cpu", quantize="gguf", quantize_required=False)
        floats = load_model(gguf, dtype="float32", device="cpu")
        rows = a.llamacpp_rows(blocks, floats, binary, gguf, new_tokens, torch.get_num_threads(), on_row)
        summary = {"gguf": gguf, "weights": blocks.quantized["weights"] if blocks.quantized else None,
                   "identical": f"{sum(r['agree'] == new_tokens for r in rows)}/{len(rows)}",
                   "agreeing_tokens": [r["agree"] for r in rows],
                   "blocks_vs_dequantized_floats": [r["floats_agree"] for r in rows]}
    else:
        from triforce.app.texts import stdlib_prose
        from triforce.model.loading import load_model

        lm = load_model(model, dtype="bfloat16", device="cpu")
        words = stdlib_prose().split()
        passages = [" ".join(words[(i * len(words)) // prompts:][:prompt_tokens]) for i in range(prompts)]
        ids = [lm.tokenizer(p, add_special_tokens=False).input_ids[:prompt_tokens] for p in passages]
        names = [m for m in methods.split(",") if m]
        rows = a.speculation_rows(lm, ids, new_tokens, names, on_row)
        summary = {"model": str(lm.path), "dtype": "bfloat16", "prompt_tokens": prompt_tokens,
                   "identical": {m: f"{sum(r['identical'] for r in rows if r['method'] == m)}/{prompts}" for m in names},
                   "margins_where_parted": [r["ar_top2_margin"] for r in rows if "ar_top2_margin" in r]}
    summary.update(against=against, new_tokens=new_tokens)
    print(json.dumps({**summary, "rows": rows} if as_json else summary))
