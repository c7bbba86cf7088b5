"""`triforce eval acceptance`, `triforce eval needle` and `triforce eval loops`."""
from __future__ import annotations

import json
import sys

import click

from triforce.app.inputs import read_prompt, read_text_file, text_bound
from triforce.cli.options import (FLOAT, INT, SEED, context_options, device_option, dtype_option, int_list, threads_option,
                                  model_option)
from triforce.errors import UserError


@click.group("eval")
def eval_group():
    """Measure what the numbers do not show: how well sparse caches stand in for the full cache,
    where two computations of one model part, how often chat answers loop; make test prompts."""


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
@click.option("--drafts", default=None,
              help="Instead of the policy table: run the decoding loop (retrieval tier at the first --budgets, "
                   "--gamma1, --gamma2) with each of these tier 0s (lookup, none, or a draft model path) at each "
                   "of --temperatures, and report each tier's acceptance.")
@click.option("--temperatures", default="0,0.6", show_default=True, help="With --drafts: temperatures to run at.")
@click.option("--gamma1", type=INT, default=4, show_default=True, help="With --drafts: tier-0 drafts per tier-1 check.")
@click.option("--gamma2", type=INT, default=8, show_default=True, help="With --drafts: drafts per full verify.")
@dtype_option
@device_option
@context_options
@threads_option
@click.option("--json", "as_json", is_flag=True, help='Print {"results": [...]} (with --drafts {"tiers": [...]}) as JSON.')
def acceptance(model, prompt_file, budgets, policies, gen, chunk_size, sink_tokens, temperature, drafts, temperatures,
               gamma1, gamma2, dtype, device, max_context, rope_scaling, threads, as_json):
    """Greedy match rate and expected acceptance of each sparse cache policy and budget, over the
    full cache's greedy continuation of the prompt (paper Table 1 in miniature).

    With --drafts, the acceptance of each tier of the real decoding loop instead: the fraction of
    drafts each tier keeps and the per-token rate the cost model takes from it. Measure on text
    like yours: prose that repeats itself is drafted far better than prose that does not."""
    from tqdm import tqdm

    from triforce.app.evaluation import evaluate_acceptance
    from triforce.app.progress import PROGRESS_DELAY_S, prefill_bar
    from triforce.model.context_stretch import run_context, stretch_request
    from triforce.model.loading import load_model

    budget_list, policy_list = _acceptance_grid(budgets, policies, gen, temperature, chunk_size, sink_tokens)
    temps = _temperatures(temperatures) if drafts is not None else []
    text = read_prompt(None, prompt_file)  # stdin now; a file is checked now and read below
    from triforce.app.threads import use_threads
    use_threads(threads)
    lm = load_model(model, dtype=dtype, device=device, rope_scaling=stretch_request(max_context, rope_scaling))
    context = run_context(lm.config.max_position_embeddings, max_context)
    if text is None:
        whose = "the model's" if max_context is None else "the"
        text = read_text_file(prompt_file, "prompt file", text_bound(context), f"{whose} {context}-token context")
    ids = lm.tokenizer(text).input_ids
    if len(ids) + gen > context:
        raise UserError(f"the prompt has {len(ids)} tokens; with --gen {gen} that exceeds the "
                        f"context of {context} tokens")
    if drafts is not None:
        _tier_table(lm, ids, drafts, temps, gen, budget_list[0], chunk_size, gamma1, gamma2, dtype, device, as_json)
        return
    total = gen + gen * len(budget_list) * len(policy_list)
    prefill = prefill_bar(len(ids) - 1)
    with tqdm(total=total, desc="scoring", unit="tok", file=sys.stderr, leave=False, delay=PROGRESS_DELAY_S) as bar:
        try:
            results = evaluate_acceptance(lm, ids, budget_list, policy_list, gen, chunk_size, sink_tokens,
                                          temperature, progress=bar.update, on_prefill=prefill.update)
        finally:
            prefill.close()
    if as_json:
        print(json.dumps({"prompt_tokens": len(ids), "gen": gen, "results": results}))
        return
    print(f"prompt {len(ids)} tokens, {gen} continuation tokens, expected acceptance at T={temperature}")
    print(f"{'policy':10s} {'budget':>7s} {'greedy_match':>13s} {'expected_accept':>16s}")
    for r in results:
        print(f"{r['policy']:10s} {r['budget']:7d} {r['greedy_match']:13.3f} {r['expected_accept']:16.3f}")


def _acceptance_grid(budgets: str, policies: str, gen: int, temperature: float, chunk_size: int,
                     sink_tokens: int) -> tuple[list[int], list[str]]:
    """The budgets and policies `eval acceptance` scores, checked."""
    from triforce.cache.sparse import POLICIES
    from triforce.config import SNAPKV_WINDOW

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
    return budget_list, policy_list


def _temperatures(text: str) -> list[float]:
    try:
        temps = [float(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise UserError(f"--temperatures must be numbers >= 0, got '{text}'") from None
    if not temps or any(not t >= 0 for t in temps):
        raise UserError(f"--temperatures must be numbers >= 0, got '{text}'")
    return temps


def _tier_table(lm, ids, drafts, temps, gen, budget, chunk_size, gamma1, gamma2, dtype, device, as_json) -> None:
    from triforce.app.runtime import load_draft
    from triforce.app.tier_acceptance import evaluate_tiers
    from triforce.config import SpecParams
    from triforce.decoding.draft import LOOKUP, NO_DRAFT, Draft

    chosen = {}
    for name in (d.strip() for d in drafts.split(",") if d.strip()):
        chosen[name] = {"lookup": LOOKUP, "none": NO_DRAFT}.get(name) or Draft("model", load_draft(name, dtype, device))
    if not chosen:
        raise UserError("--drafts needs at least one of lookup, none or a model path")
    spec = SpecParams(method="triforce", budget=budget, chunk_size=chunk_size, gamma1=gamma1, gamma2=gamma2)
    from triforce.app.progress import prefill_bar

    prefill = prefill_bar(len(ids) - 1)
    try:
        rows = evaluate_tiers(lm, ids, chosen, temps, gen, spec, log=lambda line: print(line, file=sys.stderr),
                              on_prefill=prefill.update)
    finally:
        prefill.close()
    if as_json:
        print(json.dumps({"prompt_tokens": len(ids), "gen": gen, "tiers": rows}))
        return
    print(f"prompt {len(ids)} tokens, {gen} new tokens, budget {budget}, gamma1 {gamma1}, gamma2 {gamma2}")
    print(f"{'tier 0':12s} {'T':>4s} {'retrieval kept':>15s} {'full kept':>10s} {'per-token full':>15s} "
          f"{'tokens/verify':>14s}")
    for r in rows:
        kept, rate = r["acceptance_rates"], r["per_token_rates"]
        print(f"{r['draft']:12s} {r['temperature']:4.2g} {kept.get('retrieval', float('nan')):15.3f} "
              f"{kept.get('full', float('nan')):10.3f} {rate.get('full', float('nan')):15.3f} "
              f"{r['mean_tokens_per_full_verify'] or float('nan'):14.2f}")


@eval_group.command("needle")
@model_option
@click.option("--context", type=INT, required=True, help="Prompt length in tokens (approximate).")
@click.option("--out", required=True, help="File to write the prompt to.")
@click.option("--depth", type=FLOAT, default=0.5, show_default=True, help="Where the key sits: 0 start, 1 end.")
@click.option("--seed", type=SEED, default=0, show_default=True, help="Chooses the pass key.")
@click.option("--haystack", type=click.Choice(["natural", "repeated"]), default="natural", show_default=True,
              help="natural: technical prose that never repeats itself; repeated: one filler paragraph over "
                   "and over (the older test: easy to draft, a best case for speculation).")
@click.option("--ask", is_flag=True,
              help="Also ask the model (greedy, --method auto, 16 tokens) and say whether its answer names the key.")
def needle(model, context, out, depth, seed, haystack, ask):
    """Write a needle-in-a-haystack prompt: a pass key hidden in a haystack of text, ending in
    the question. The key goes to stdout as JSON; feed the file to `triforce generate
    --prompt-file`, or give --ask to have the model answer here and get a verdict."""
    from triforce.app.evaluation import needle_prompt
    from triforce.model.loading import load_tokenizer, resolve_model_dir
    from triforce.paths import write_atomically

    tokenizer = load_tokenizer(resolve_model_dir(model))
    prompt = needle_prompt(tokenizer, context, depth, seed, haystack)
    try:
        write_atomically(out, prompt.text)
    except OSError as e:
        raise UserError(f"cannot write {out}: {e.strerror}") from None
    report = {"out": out, "key": prompt.key, "tokens": prompt.tokens, "depth": depth, "haystack": haystack}
    if ask:
        from triforce.app.llm import LLM
        from triforce.app.llm_types import SamplingParams

        answer = LLM(model).generate(prompt.text, SamplingParams(max_tokens=16))
        report.update(answer=answer.text, found=prompt.key in answer.text, method=answer.stats.get("method"))
        print(f"the key {prompt.key} at depth {depth:g} of {prompt.tokens} tokens: "
              f"{'found' if report['found'] else 'NOT found'} in the answer {answer.text.strip()!r}", file=sys.stderr)
    print(json.dumps(report))


@eval_group.command("loops")
@model_option
@click.option("--question", default="What is the capital of France?", show_default=True,
              help="The user's message, sent as `triforce chat` sends a first turn.")
@click.option("--samples", type=click.IntRange(1, 1000), default=20, show_default=True, help="Answers per setting.")
@click.option("--repeat-penalties", default="1.0,1.1,1.2", show_default=True, help="Settings to compare.")
@click.option("--temperature", type=FLOAT, default=0.2, show_default=True, help="As chat's default.")
@click.option("--top-p", type=FLOAT, default=0.9, show_default=True, help="As chat's default.")
@click.option("--max-new-tokens", type=INT, default=512, show_default=True, help="As chat's default: the cap a loop hits.")
@click.option("--expect", default="Paris", show_default=True, help="Text a good answer contains.")
@dtype_option
def loops(model, question, samples, repeat_penalties, temperature, top_p, max_new_tokens, expect, dtype):
    """How often sampled chat answers loop to the token cap, per repeat penalty: seeds 0..N-1,
    one JSON line per setting (answers that ended by themselves, that contain --expect, lengths)."""
    from triforce.app.llm import LLM
    from triforce.app.llm_types import SamplingParams

    try:
        penalties = [float(x) for x in repeat_penalties.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"--repeat-penalties takes numbers separated by commas, got {repeat_penalties!r}") from None
    llm = LLM(model, dtype=dtype)
    for penalty in penalties:
        answers = [llm.chat([{"role": "user", "content": question}],
                            SamplingParams(temperature=temperature, top_p=top_p, max_tokens=max_new_tokens, seed=seed,
                                           repeat_penalty=penalty)) for seed in range(samples)]
        print(json.dumps({"repeat_penalty": penalty, "samples": samples,
                          "ended_by_themselves": sum(a.finish_reason == "stop" for a in answers),
                          "contain_expected": sum(expect in a.text for a in answers),
                          "lengths": [len(a.token_ids) for a in answers]}), flush=True)
