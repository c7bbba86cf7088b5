"""`triforce eval acceptance` and `triforce eval needle`."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from triforce.app.inputs import read_text_file, text_bound
from triforce.cli.generate_cmd import read_prompt
from triforce.cli.options import (FLOAT, INT, SEED, context_options, device_option, dtype_option, int_list,
                                  model_option)
from triforce.errors import UserError


@click.group("eval")
def eval_group():
    """Measure how well sparse caches stand in for the full cache; make test prompts."""


@eval_group.command("acceptance")
@model_option
@click.option("--prompt-file", required=True, help="Prompt text file ('-' = stdin).")
@click.option("--budgets", default="256,512,1024", show_default=True, help="Sparse cache sizes in tokens.")
@click.option("--policies", default="streaming,retrieval,topk", show_default=True,
              help="Any of streaming, retrieval, topk (token-level oracle), snapkv (the tokens the "
                   "prompt's last 32 tokens attend to most, pooled over 5 neighbours, as MagicDec's drafts).")
@click.option("--gen", type=INT, default=64, show_default=True, help="Continuation tokens to score.")
@click.option("--chunk-size", type=INT, default=8, show_default=True)
@click.option("--sink-tokens", type=INT, default=16, show_default=True, help="StreamingLLM sink tokens.")
@click.option("--temperature", type=FLOAT, default=0.6, show_default=True,
              help="Temperature of the expected-acceptance figure.")
@dtype_option
@device_option
@context_options
@click.option("--json", "as_json", is_flag=True, help='Print {"results": [...]} as JSON.')
def acceptance(model, prompt_file, budgets, policies, gen, chunk_size, sink_tokens, temperature, dtype,
               device, max_context, rope_scaling, as_json):
    """Greedy match rate and expected acceptance of each sparse cache policy and budget, over the
    full cache's greedy continuation of the prompt (paper Table 1 in miniature)."""
    from tqdm import tqdm

    from triforce.app.evaluation import evaluate_acceptance
    from triforce.cache.sparse import POLICIES
    from triforce.config import SNAPKV_WINDOW
    from triforce.model.context_stretch import run_context, stretch_request
    from triforce.model.loading import load_model

    budget_list = int_list(budgets, "--budgets")
    policy_list = [p.strip() for p in policies.split(",") if p.strip()]
    unknown = set(policy_list) - set(POLICIES)
    if unknown or not policy_list:
        raise UserError(f"unknown policies {sorted(unknown) or policies!r} (use {', '.join(POLICIES)})")
    if "snapkv" in policy_list and min(budget_list) <= SNAPKV_WINDOW:
        raise UserError(f"--budgets for snapkv must exceed its {SNAPKV_WINDOW}-token observation window")
    if gen < 1:
        raise UserError(f"--gen must be >= 1, got {gen}")
    if not temperature > 0:
        raise UserError(f"--temperature must be > 0, got {temperature}")
    for b in budget_list:
        if b < 2 * chunk_size or b <= sink_tokens:
            raise UserError(f"budget {b} must hold two chunks ({2 * chunk_size}) and exceed {sink_tokens} sinks")
    text = read_prompt(None, prompt_file)  # stdin now; a file is checked now and read below
    lm = load_model(model, dtype=dtype, device=device, rope_scaling=stretch_request(max_context, rope_scaling))
    context = run_context(lm.config.max_position_embeddings, max_context)
    if text is None:
        whose = "the model's" if max_context is None else "the"
        text = read_text_file(prompt_file, "prompt file", text_bound(context), f"{whose} {context}-token context")
    ids = lm.tokenizer(text).input_ids
    if len(ids) + gen > context:
        raise UserError(f"the prompt has {len(ids)} tokens; with --gen {gen} that exceeds the "
                        f"context of {context} tokens")
    total = gen + gen * len(budget_list) * len(policy_list)
    with tqdm(total=total, desc="scoring", unit="tok", file=sys.stderr, leave=False) as bar:
        results = evaluate_acceptance(lm, ids, budget_list, policy_list, gen, chunk_size, sink_tokens,
                                      temperature, progress=bar.update)
    if as_json:
        print(json.dumps({"prompt_tokens": len(ids), "gen": gen, "results": results}))
        return
    print(f"prompt {len(ids)} tokens, {gen} continuation tokens, expected acceptance at T={temperature}")
    print(f"{'policy':10s} {'budget':>7s} {'greedy_match':>13s} {'expected_accept':>16s}")
    for r in results:
        print(f"{r['policy']:10s} {r['budget']:7d} {r['greedy_match']:13.3f} {r['expected_accept']:16.3f}")


@eval_group.command("needle")
@model_option
@click.option("--context", type=INT, required=True, help="Prompt length in tokens (approximate).")
@click.option("--out", required=True, help="File to write the prompt to.")
@click.option("--depth", type=FLOAT, default=0.5, show_default=True, help="Where the key sits: 0 start, 1 end.")
@click.option("--seed", type=SEED, default=0, show_default=True, help="Chooses the pass key.")
def needle(model, context, out, depth, seed):
    """Write a needle-in-a-haystack prompt: a pass key hidden in filler text, ending in the
    question. The key goes to stdout; feed the file to `triforce generate --prompt-file`."""
    from triforce.app.evaluation import needle_prompt
    from triforce.model.loading import load_tokenizer, resolve_model_dir

    tokenizer = load_tokenizer(resolve_model_dir(model))
    prompt = needle_prompt(tokenizer, context, depth, seed)
    try:
        Path(out).write_text(prompt.text, encoding="utf-8")
    except OSError as e:
        raise UserError(f"cannot write {out}: {e.strerror}") from None
    print(json.dumps({"out": out, "key": prompt.key, "tokens": prompt.tokens, "depth": depth}))
