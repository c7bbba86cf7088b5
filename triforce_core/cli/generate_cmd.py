"""`triforce generate`: one prompt in, one continuation out (streamed, or as JSON)."""
from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass

import click

from triforce.app.inputs import check_text_file, read_text_file, text_bound
from triforce.app.runtime import RunConfig
from triforce.cli.options import (INT, build_sampling, build_spec, check_non_negative, check_output_path,
                                  context_options, device_option, dtype_option,
                                  model_option, offload_options, runtime_options, sampling_options,
                                  speculation_options)
from triforce.errors import UserError


STDIN_PROMPT_BYTES = 64 << 20  # stdin has no size to check first: read at most this much


def read_prompt(prompt: str | None, prompt_file: str | None) -> str | None:
    """The prompt text now, for --prompt and stdin; None for a file, which is checked now and read
    after the model is known (app.inputs.read_text_file), so its size can be bounded by the context."""
    if (prompt is None) == (prompt_file is None):
        raise UserError("give exactly one of --prompt and --prompt-file")
    if prompt is not None:
        return prompt
    if prompt_file == "-":
        data = sys.stdin.buffer.read(STDIN_PROMPT_BYTES + 1)
        if len(data) > STDIN_PROMPT_BYTES:
            raise UserError(f"the prompt on stdin is longer than {STDIN_PROMPT_BYTES:,} bytes")
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise UserError(f"the prompt on stdin is not UTF-8 text ({e.reason} at byte {e.start})") from None
    check_text_file(prompt_file, "prompt file")
    return None


def encode_prompt(lm, text: str, as_chat: bool, context: int) -> list[int]:
    tok = lm.tokenizer
    if as_chat:
        if not getattr(tok, "chat_template", None):
            raise UserError("--chat needs a model with a chat template")
        from triforce.app.inputs import text_bound
        from triforce.model.chat_template import render_chat

        rendered = render_chat(tok, [{"role": "user", "content": text}], True, text_bound(context))
        return tok(rendered, add_special_tokens=False).input_ids
    return tok(text).input_ids  # exactly the tokenizer's default, special tokens included


@click.command()
@model_option
@click.option("--prompt", default=None, help="Prompt text.")
@click.option("--prompt-file", default=None, help="Read the prompt from this file ('-' = stdin).")
@click.option("--prompts", "prompts_file", default=None,
              help='Decode many prompts as one batch: a JSON-lines file, one {"prompt": "..."} per line.')
@click.option("--batch-size", type=INT, default=None,
              help="With --prompts: rows decoded at once (default: as many as the memory plan fits).")
@speculation_options(default_method="auto")
@click.option("--max-new-tokens", type=INT, default=128, show_default=True, help="Tokens to generate at most.")
@context_options
@sampling_options(default_temperature=0.0)
@dtype_option
@device_option
@click.option("--chat", "as_chat", is_flag=True, help="Wrap the prompt in the model's chat template.")
@click.option("--ignore-eos", is_flag=True, help="Keep generating past end-of-sequence tokens.")
@offload_options
@click.option("--no-overlap", is_flag=True, help="Copy offloaded KV with the plain schedule (no prefetch).")
@click.option("--no-hybrid", is_flag=True,
              help="Stream all offloaded KV over PCIe (by default, on a GPU whose profile measured the CPU's attention "
                   "rates, CPU threads attend a share of it in place during decoding and verify passes).")
@click.option("--record-acceptance", default=None,
              help="Write each check's proposed/accepted counts to this JSON file (for `bench offload`).")
@click.option("--tp", type=INT, default=1, show_default=True,
              help="Tensor-parallel ranks: the verifier's heads and KV split over N GPUs (gloo processes on a CPU).")
@runtime_options()
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of streamed text.")
def generate(model, prompt, prompt_file, prompts_file, batch_size, method, draft, budget, chunk_size, gamma1, gamma2, rebuild_stride,
             rebuild_threshold, max_new_tokens, max_context, rope_scaling, temperature, top_p, top_k, seed, dtype,
             device, as_chat,
             ignore_eos, profile, device_budget, no_overlap, no_hybrid, record_acceptance, tp, attn, no_graphs, count_syncs,
             as_json):
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
    config = RunConfig(model=model, draft=draft, spec=spec, fixed=fixed, dtype=dtype, device=device, profile=profile,
                       device_budget=device_budget, attn=attn, graphs="off" if no_graphs else "auto",
                       overlap=not no_overlap, hybrid=not no_hybrid, count_syncs=count_syncs, max_context=max_context,
                       rope_scaling=rope_scaling)
    if prompts_file is not None:
        from triforce.cli.generate_batch import run_generate_batch
        params = build_sampling(temperature, top_p, top_k, seed)
        run_generate_batch(config, prompts_file, batch_size, as_chat, params, max_new_tokens, ignore_eos, as_json)
        return
    request = GenerateRequest(config=config, text=read_prompt(prompt, prompt_file), prompt_file=prompt_file,
                              as_chat=as_chat,
                              params=build_sampling(temperature, top_p, top_k, seed), max_new_tokens=max_new_tokens,
                              ignore_eos=ignore_eos, record_acceptance=record_acceptance, as_json=as_json)
    from triforce.app.parallel import run_on_ranks
    run_on_ranks(tp, generate_rank, request, model, device)


@dataclass(frozen=True)
class GenerateRequest:
    """Everything a generate run needs, picklable so tensor-parallel ranks can receive it."""
    config: RunConfig
    text: str | None              # the prompt, or None: read prompt_file once the context is known
    prompt_file: str | None
    as_chat: bool
    params: object                # SamplingParams
    max_new_tokens: int
    ignore_eos: bool
    record_acceptance: str | None
    as_json: bool


def generate_rank(rank: int, world: int, request: GenerateRequest) -> None:
    """One tensor-parallel rank (started by triforce.offload.tp.launch)."""
    run_generate(request, rank, world)


def run_generate(r: GenerateRequest, rank: int = 0, world: int = 1) -> None:
    """Load, plan, prefill, decode; rank 0 prints."""
    from triforce.app.runtime import build_runtime
    from triforce.app.textstream import TextStream

    speaker = rank == 0
    runtime = build_runtime(r.config, rank, world)
    lm = runtime.lm
    context = runtime.context
    whose = "the model's" if r.config.max_context is None else "the"
    text = r.text if r.text is not None else read_text_file(
        r.prompt_file, "prompt file", text_bound(context), f"{whose} {context}-token context")
    ids = encode_prompt(lm, text, r.as_chat, context)
    max_new_tokens = r.max_new_tokens
    if not ids:
        raise UserError("the prompt is empty after tokenisation")
    if len(ids) >= context:
        raise UserError(f"the prompt has {len(ids)} tokens but {whose} context is {context} tokens")
    if len(ids) + max_new_tokens > context:
        max_new_tokens = context - len(ids)
        if speaker:
            print(f"note: generating at most {max_new_tokens} tokens to stay within the "
                  f"{context}-token context", file=sys.stderr)
    max_len = len(ids) + max(max_new_tokens, 1)
    run = runtime.plan(max_len)
    engine = runtime.engine(max_len, run)
    plan, spec = run.plan, run.spec
    stream = TextStream(lm.tokenizer)

    def show(token: int) -> None:
        if speaker and not r.as_json:
            sys.stdout.write(stream.push(token))
            sys.stdout.flush()

    if not r.as_json:
        runtime.say_attention()
        if run.auto is not None and speaker:
            print(run.auto.describe(), file=sys.stderr)
    run_started = time.perf_counter()
    engine.set_sequence(ids)
    prefill_s = time.perf_counter() - run_started
    stop_ids = frozenset() if r.ignore_eos else lm.eos_ids
    result = engine.generate(max_new_tokens, r.params, stop_ids, on_token=show)
    time_s = time.perf_counter() - run_started
    if not speaker:
        return
    method = spec.method
    summary = {
        "text": lm.tokenizer.decode(result.tokens, skip_special_tokens=True),
        "tokens": result.tokens,
        "prompt_tokens": len(ids),
        "new_tokens": len(result.tokens),
        "method": method,
        "method_choice": run.auto.to_json() if run.auto is not None else None,
        "time_s": round(time_s, 4),
        "prefill_s": round(prefill_s, 4),
        "decode_s": round(result.time_s, 4),
        "tokens_per_s": round(len(result.tokens) / result.time_s, 3) if result.time_s else None,
        "stopped_by": result.stopped_by,
        "model": str(lm.path),
        "dtype": str(lm.dtype).removeprefix("torch."),
        "device": str(lm.device),
        "tp": world,
        "attention": runtime.attn_name,
        "drafting_runner": engine.runner_mode,
        "load_s": round(runtime.load_s, 3),
        **result.stats,
        "speculation": {"budget": spec.budget, "chunk_size": spec.chunk_size, "gamma1": spec.gamma1,
                        "gamma2_start": spec.gamma2, "gamma2_range": list(spec.gamma2_range),
                        "chosen_by_cost_model": sorted(set(("budget", "chunk_size", "gamma1", "gamma2")) - r.config.fixed)
                        if run.choice else []} if spec.method != "ar" else None,
        "plan": plan.to_json(),
    }
    trace_error = None
    if r.record_acceptance:
        from triforce.decoding.acceptance_trace import save_trace
        try:
            save_trace(r.record_acceptance, engine.rounds, {
                "model": str(lm.path), "method": method, "tiers": engine.describe(), "prompt_tokens": len(ids),
                "budget": spec.budget, "chunk_size": spec.chunk_size, "gamma1": spec.gamma1, "gamma2": spec.gamma2,
                "temperature": r.params.temperature})
        except UserError as e:  # checked before the run, yet the disk may fill: the result still prints
            trace_error = e
    if r.as_json:
        print(json.dumps(summary))
        if trace_error is not None:
            raise trace_error
        return
    print()
    speculation = ""
    if method != "ar":
        speculation = (f", {engine.describe()}, acceptance {result.stats['acceptance_rates']}, "
                       f"{result.stats['mean_tokens_per_full_verify']} tokens per full verify")
    offload = ""
    if plan.offloaded:
        offload = f", KV of {plan.context - plan.resident_tokens} of {plan.context} tokens offloaded to host memory"
    if r.config.count_syncs:
        print(f"host syncs: {summary['host_syncs']}", file=sys.stderr)
    print(f"[{summary['new_tokens']} tokens, {summary['tokens_per_s']} tok/s decode, "
          f"prompt {len(ids)} tokens in {summary['prefill_s']} s, stopped by {result.stopped_by}"
          f"{speculation}{offload}{', tp %d' % world if world > 1 else ''}]", file=sys.stderr)
    if trace_error is not None:
        raise trace_error
