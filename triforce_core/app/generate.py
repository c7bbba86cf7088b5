"""`triforce generate`'s use case, built on triforce.LLM: load, encode and decode one prompt; rank 0
streams the text to stdout and the summary to stderr (or prints one JSON object)."""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass

from triforce.app.inputs import read_text_file, text_bound
from triforce.app.progress import prefill_bar
from triforce.config import RunConfig
from triforce.errors import UserError


def ended_at_once(lm, result, as_chat: bool) -> bool:
    """A raw prompt to a model with a chat template, answered by an end-of-sequence token at once
    (an instruction model waits for its template: `generate --prompt "Write one sentence about
    the sea."` printed nothing)."""
    return (not as_chat and result.stopped_by == "eos" and len(result.tokens) <= 1
            and bool(getattr(lm.tokenizer, "chat_template", None)))


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
    """One tensor-parallel rank (started by triforce.app.ranks.launch)."""
    run_generate(request, rank, world)


def run_generate(r: GenerateRequest, rank: int = 0, world: int = 1) -> None:
    """Load (triforce.LLM), encode, decode; rank 0 prints."""
    from triforce.app.llm import LLM
    from triforce.app.llm_types import SamplingParams
    from triforce.app.completion import room_for

    speaker = rank == 0
    llm = LLM.from_config(r.config, rank, world)
    runtime, lm, context = llm.runtime, llm.runtime.lm, llm.context
    whose = "the model's" if r.config.max_context is None else "the"
    text = r.text if r.text is not None else read_text_file(
        r.prompt_file, "prompt file", text_bound(context), f"{whose} {context}-token context")
    ids = llm.encode(text, r.as_chat)
    max_new_tokens = room_for(ids, context, r.max_new_tokens, whose)
    if max_new_tokens < r.max_new_tokens and speaker:
        print(f"note: generating at most {max_new_tokens} tokens to stay within the "
              f"{context}-token context", file=sys.stderr)
    params = SamplingParams.of(r.params, max_tokens=max_new_tokens, ignore_eos=r.ignore_eos)
    bars = []

    def show(piece: str) -> None:
        sys.stdout.write(piece)
        sys.stdout.flush()

    def before_prefill(run) -> None:
        if not r.as_json:
            runtime.say_attention()
            if run.auto is not None and speaker:
                print(run.auto.describe(), file=sys.stderr)
        if speaker:
            bars.append(prefill_bar(len(ids) - 1))

    try:
        answer = llm.complete_ids(ids, params, on_text=show if speaker and not r.as_json else None,
                                  on_prefill=lambda done, total: bars and bars[0].update(done - bars[0].n),
                                  before_prefill=before_prefill)
    finally:
        for bar in bars:
            bar.close()
    if speaker:
        report(r, lm, ids, answer, world)


def report(r: GenerateRequest, lm, ids: list[int], answer, world: int) -> None:
    """Rank 0's end of a run: the summary line on stderr (or the JSON object on stdout) and the
    acceptance trace asked for."""
    done = answer.completion
    result, engine, spec, method = done.result, done.engine, done.run.spec, done.method
    if ended_at_once(lm, result, r.as_chat):
        print("note: the model ended its answer at once. It has a chat template: an instruction model "
              "expects its prompt in that template; try --chat", file=sys.stderr)
    summary = answer.stats
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
    else:
        print()
        if r.config.count_syncs:
            print(f"host syncs: {summary['host_syncs']}", file=sys.stderr)
        print(summary_line(r, summary, done, len(ids), world), file=sys.stderr)
    if trace_error is not None:
        raise trace_error


def summary_line(r: GenerateRequest, summary: dict, done, prompt_tokens: int, world: int) -> str:
    """`[64 tokens, 31.1 tok/s decode, prompt 2048 tokens in 3.2 s, stopped by length, ...]`"""
    result, plan = done.result, done.run.plan
    speculation = ""
    if done.method != "ar":
        speculation = (f", {done.engine.describe()}, acceptance {result.stats['acceptance_rates']}, "
                       f"{result.stats['mean_tokens_per_full_verify']} tokens per full verify")
    offload = ""
    if plan.offloaded:
        offload = f", KV of {plan.context - plan.resident_tokens} of {plan.context} tokens offloaded to host memory"
    return (f"[{summary['new_tokens']} tokens, {summary['tokens_per_s']} tok/s decode, "
            f"prompt {prompt_tokens} tokens in {summary['prefill_s']} s, stopped by {result.stopped_by}"
            f"{speculation}{offload}{', tp %d' % world if world > 1 else ''}]")
