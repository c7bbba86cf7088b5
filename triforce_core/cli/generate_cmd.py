"""`triforce generate`: one prompt in, one continuation out (streamed, or as JSON)."""
from __future__ import annotations

import click

from triforce.app.inputs import check_text_file, read_prompt
from triforce.config import RunConfig, SamplingParams
from triforce.cli.options import (INT, build_spec, check_non_negative, check_output_path,
                                  context_options, device_option, dtype_option, quantize_option,
                                  model_option, offload_options, runtime_options, sampling_options,
                                  speculation_options)
from triforce.errors import UserError


@click.command()
@model_option
@click.option("--prompt", default=None, help="Prompt text.")
@click.option("--prompt-file", default=None, help="Read the prompt from this file ('-' = stdin).")
@click.option("--prompts", "prompts_file", default=None,
              help='Decode many prompts as one batch: a JSON-lines file, one {"prompt": "..."} per line.')
@click.option("--batch-size", type=INT, default=None,
              help="With --prompts: rows decoded at once (default: as many as the memory plan and the host's free "
                   "memory fit, at most 32).")
@speculation_options(default_method="auto")
@click.option("--max-new-tokens", type=INT, default=128, show_default=True, help="Tokens to generate at most.")
@context_options
@sampling_options(SamplingParams())  # greedy unless asked: a run reproduces exactly
@dtype_option
@quantize_option
@device_option
@click.option("--chat", "as_chat", is_flag=True, help="Wrap the prompt in the model's chat template.")
@click.option("--ignore-eos", is_flag=True, help="Keep generating past end-of-sequence tokens.")
@click.option("--parse-special-tokens", is_flag=True,
              help="Read control tokens written inside a chat message (e.g. <|im_end|>) as control tokens. "
                   "By default a message's text is tokenized as text, so a user cannot forge the template's "
                   "role markers.")
@offload_options
@click.option("--no-overlap", is_flag=True, help="Copy offloaded KV with the plain schedule (no prefetch).")
@click.option("--no-hybrid", is_flag=True,
              help="Stream all offloaded KV over PCIe (by default, on a GPU whose profile measured the CPU's attention "
                   "rates, CPU threads attend a share of it in place during decoding and verify passes).")
@click.option("--draft-ahead", is_flag=True,
              help="Draft the next cycle while the full tier verifies this one; the drafts are kept when the verify "
                   "accepts every draft and its bonus token is the one guessed. Meant for a GPU whose verify "
                   "streams offloaded KV (not yet measured on one); on a CPU it runs in turn and costs time.")
@click.option("--record-acceptance", default=None,
              help="Write each check's proposed/accepted counts to this JSON file (for `bench offload`).")
@click.option("--tp", type=INT, default=1, show_default=True,
              help="Tensor-parallel ranks: the verifier's heads and KV split over N GPUs (gloo processes on a CPU).")
@runtime_options()
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of streamed text.")
def generate(model, prompt, prompt_file, prompts_file, batch_size, method, draft, budget, chunk_size, gamma1, gamma2, rebuild_stride,
             rebuild_threshold, max_new_tokens, max_context, rope_scaling, sampling, dtype,
             quantize, device, as_chat,
             ignore_eos, parse_special_tokens, profile, device_budget, no_overlap, no_hybrid, draft_ahead, record_acceptance, tp, attn, no_graphs, count_syncs,
             threads, as_json):
    """Generate a continuation of a prompt.

    The raw prompt is tokenised exactly as the model's transformers tokenizer does by default;
    --chat applies the chat template instead. Text streams to stdout and a summary goes to
    stderr; --json prints text, tokens, prompt_tokens, method, time_s, tokens_per_s, the
    speculation statistics and the memory plan. The plan (see `triforce plan`) decides how much
    KV stays on the device; the rest is offloaded to host memory.

    --prompts decodes a file of prompts together, up to --batch-size rows at once (a row that
    finishes takes the next prompt): each row's tokens are those of its own single run. Texts
    print in input order; --json prints {"results": [one object per prompt], "batch":
    {throughput, per-token latency, acceptance, ...}}.
    """
    check_non_negative("--max-new-tokens", max_new_tokens)
    check_output_path("--record-acceptance", record_acceptance)
    if tp < 1:
        raise UserError(f"--tp must be >= 1, got {tp}")
    if prompts_file is None and batch_size is not None:
        raise UserError("--batch-size goes with --prompts")
    if prompts_file is not None:
        if prompt is not None or prompt_file is not None:
            raise UserError("give one of --prompt, --prompt-file and --prompts")
        for flag, given in (("--record-acceptance", record_acceptance), ("--tp", tp > 1)):
            if given:
                raise UserError(f"{flag} is for a single prompt, not with --prompts")
        check_text_file(prompts_file, "prompts file")
    spec, fixed = build_spec(method, budget, chunk_size, gamma1, gamma2, rebuild_stride, rebuild_threshold)
    config = RunConfig(model=model, draft=draft, spec=spec, fixed=fixed, dtype=dtype, quantize=quantize, device=device, profile=profile,
                       device_budget=device_budget, attn=attn, graphs="off" if no_graphs else "auto",
                       overlap=not no_overlap, hybrid=not no_hybrid, draft_ahead=draft_ahead, count_syncs=count_syncs, max_context=max_context,
                       rope_scaling=rope_scaling, threads=threads, parse_special_tokens=parse_special_tokens)
    if prompts_file is not None:
        from triforce.app.generate_prompts import run_generate_batch
        run_generate_batch(config, prompts_file, batch_size, as_chat, sampling, max_new_tokens, ignore_eos, as_json)
        return
    from triforce.app.generate import GenerateRequest, generate_rank
    from triforce.app.parallel import run_on_ranks

    request = GenerateRequest(config=config, text=read_prompt(prompt, prompt_file), prompt_file=prompt_file,
                              as_chat=as_chat,
                              params=sampling, max_new_tokens=max_new_tokens,
                              ignore_eos=ignore_eos, record_acceptance=record_acceptance, as_json=as_json)
    run_on_ranks(tp, generate_rank, request, model, device)
