"""`triforce generate`: one prompt in, one continuation out (streamed, or as JSON)."""
from __future__ import annotations

import click

from triforce.app.inputs import check_text_file, read_prompt
from triforce.config import SamplingParams
from triforce.cli.options import (INT, check_non_negative, check_output_path, run_config, run_options, sampling_of,
                                  sampling_options)
from triforce.errors import UserError


@click.command()
@run_options(default_method="auto", count_syncs=True, schedule=True, special_tokens=True)
@click.option("--prompt", default=None, help="Prompt text.")
@click.option("--prompt-file", default=None, help="Read the prompt from this file ('-' = stdin).")
@click.option("--prompts", "prompts_file", default=None,
              help='Decode many prompts as one batch: a JSON-lines file, one {"prompt": "..."} per line.')
@click.option("--batch-size", type=INT, default=None,
              help="With --prompts: rows decoded at once (default: as many as the memory plan and the host's free "
                   "memory fit, at most 32).")
@click.option("--max-new-tokens", type=INT, default=128, show_default=True, help="Tokens to generate at most.")
@sampling_options(SamplingParams())  # greedy unless asked: a run reproduces exactly
@click.option("--chat", "as_chat", is_flag=True, help="Wrap the prompt in the model's chat template.")
@click.option("--ignore-eos", is_flag=True, help="Keep generating past end-of-sequence tokens.")
@click.option("--record-acceptance", default=None,
              help="Write each check's proposed/accepted counts to this JSON file (for `bench offload`).")
@click.option("--tp", type=INT, default=1, show_default=True,
              help="Tensor-parallel ranks: the verifier's heads and KV split over N GPUs (gloo processes on a CPU).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of streamed text.")
def generate(prompt, prompt_file, prompts_file, batch_size, max_new_tokens, as_chat, ignore_eos, record_acceptance,
             tp, as_json, **flags):
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
    sampling, config = sampling_of(flags, SamplingParams()), run_config(flags)
    if prompts_file is not None:
        from triforce.app.generate_prompts import run_generate_batch
        run_generate_batch(config, prompts_file, batch_size, as_chat, sampling, max_new_tokens, ignore_eos, as_json)
        return
    from triforce.app.generate import GenerateRequest, generate_rank, run_generate

    request = GenerateRequest(config=config, text=read_prompt(prompt, prompt_file), prompt_file=prompt_file,
                              as_chat=as_chat,
                              params=sampling, max_new_tokens=max_new_tokens,
                              ignore_eos=ignore_eos, record_acceptance=record_acceptance, as_json=as_json)
    if tp == 1:  # in this process, no rank launched: the short way to the engine (test_frames)
        run_generate(request)
        return
    from triforce.app.parallel import run_on_ranks
    run_on_ranks(tp, generate_rank, request, config.model, config.device)
