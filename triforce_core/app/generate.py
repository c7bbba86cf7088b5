"""`triforce generate`'s use case: load, plan, prefill and decode one prompt; rank 0 streams the
text to stdout and the summary to stderr (or prints one JSON object)."""
from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass

from triforce.app.inputs import read_text_file, text_bound
from triforce.app.progress import prefill_bar
from triforce.app.threads import threads_in_use
from triforce.config import RunConfig
from triforce.errors import UserError


def encode_prompt(lm, text: str, as_chat: bool, context: int, parse_special: bool = False) -> list[int]:
    """With as_chat, the prompt is a user message: its text stays text unless parse_special."""
    tok = lm.tokenizer
    if as_chat:
        if not getattr(tok, "chat_template", None):
            raise UserError("--chat needs a model with a chat template")
        from triforce.model.chat_template import chat_ids

        return chat_ids(tok, [{"role": "user", "content": text}], True, text_bound(context), parse_special)
    return tok(text).input_ids  # a raw prompt: exactly the tokenizer's default, special tokens included


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


def room_for(ids: list[int], context: int, max_new_tokens: int, whose: str = "the model's") -> int:
    """The new tokens a prompt of `ids` may have within the context (a UserError if none fit)."""
    if not ids:
        raise UserError("the prompt is empty after tokenisation")
    if len(ids) >= context:
        raise UserError(f"the prompt has {len(ids)} tokens but {whose} context is {context} tokens")
    return min(max_new_tokens, context - len(ids))


@dataclass
class Completion:
    """One prompt decoded: the engine's result and what made it."""
    ids: list[int]
    result: object         # triforce.decoding.statistics.GenerationResult
    run: object            # the RunPlan it was decoded under
    engine: object
    prefill_s: float
    time_s: float

    @property
    def method(self) -> str:
        """The method that decoded: auto's gate may have kept every token on ar."""
        if self.run.auto is not None and self.result.stats.get("auto_ar_tokens", 0) >= len(self.result.tokens) > 0:
            return "ar"
        return self.run.spec.method


def complete(runtime, ids: list[int], params, max_new_tokens: int, stop_ids: frozenset, *, on_token=None,
             progress=None, stop_requested=None, before_prefill=None) -> Completion:
    """Plan for the prompt and its new tokens, build the engine, prefill, decode: the one path from
    token ids to tokens of `triforce generate` and of triforce.LLM."""
    max_len = len(ids) + max(max_new_tokens, 1)
    run = runtime.plan(max_len)
    engine = runtime.engine(max_len, run, stop_requested=stop_requested)
    if before_prefill is not None:
        before_prefill(run)
    started = time.perf_counter()
    engine.set_sequence(ids, progress)
    prefill_s = time.perf_counter() - started
    result = engine.generate(max_new_tokens, params, stop_ids, on_token=on_token)
    return Completion(ids, result, run, engine, prefill_s, time.perf_counter() - started)


def summary_of(runtime, c: Completion, world: int = 1) -> dict:
    """The JSON summary of one completion (`generate --json`; triforce.Result.stats)."""
    lm, result, spec, plan = runtime.lm, c.result, c.run.spec, c.run.plan
    return {
        "text": lm.tokenizer.decode(result.tokens, skip_special_tokens=True),
        "tokens": result.tokens,
        "prompt_tokens": len(c.ids),
        "new_tokens": len(result.tokens),
        "method": c.method,
        "method_choice": c.run.auto.to_json() if c.run.auto is not None else None,
        "time_s": round(c.time_s, 4),
        "prefill_s": round(c.prefill_s, 4),
        "decode_s": round(result.time_s, 4),
        "tokens_per_s": round(len(result.tokens) / result.time_s, 3) if result.time_s else None,
        "stopped_by": result.stopped_by,
        "model": str(lm.path),
        "dtype": str(lm.dtype).removeprefix("torch."),
        "quantized": lm.quantized,
        "device": str(lm.device),
        "tp": world,
        "threads": threads_in_use(),
        "attention": runtime.attn_name,
        "drafting_runner": c.engine.runner_mode,
        "graphs": {t.name: t.runner.report() for t in c.engine.levels if getattr(t, "runner", None) is not None},
        "load_s": round(runtime.load_s, 3),
        **result.stats,
        "speculation": {"budget": spec.budget, "chunk_size": spec.chunk_size, "gamma1": spec.gamma1,
                        "gamma2_start": spec.gamma2, "gamma2_range": list(spec.gamma2_range),
                        "chosen_by_cost_model": sorted({"budget", "chunk_size", "gamma1", "gamma2"}
                                                       - runtime.config.fixed) if c.run.choice else []}
        if spec.method != "ar" else None,
        "plan": plan.to_json(),
    }


def run_generate(r: GenerateRequest, rank: int = 0, world: int = 1) -> None:
    """Load, plan, prefill, decode (complete); rank 0 prints."""
    from triforce.app.runtime import build_runtime
    from triforce.app.textstream import TextStream

    speaker = rank == 0
    runtime = build_runtime(r.config, rank, world)
    lm = runtime.lm
    context = runtime.context
    whose = "the model's" if r.config.max_context is None else "the"
    text = r.text if r.text is not None else read_text_file(
        r.prompt_file, "prompt file", text_bound(context), f"{whose} {context}-token context")
    ids = encode_prompt(lm, text, r.as_chat, context, r.config.parse_special_tokens)
    max_new_tokens = room_for(ids, context, r.max_new_tokens, whose)
    if max_new_tokens < r.max_new_tokens and speaker:
        print(f"note: generating at most {max_new_tokens} tokens to stay within the "
              f"{context}-token context", file=sys.stderr)
    stream = TextStream(lm.tokenizer)

    def show(token: int) -> None:
        if speaker and not r.as_json:
            sys.stdout.write(stream.push(token))
            sys.stdout.flush()

    bars = []

    def before_prefill(run) -> None:
        if not r.as_json:
            runtime.say_attention()
            if run.auto is not None and speaker:
                print(run.auto.describe(), file=sys.stderr)
        if speaker:
            bars.append(prefill_bar(len(ids) - 1))

    try:
        done = complete(runtime, ids, r.params, max_new_tokens, frozenset() if r.ignore_eos else lm.eos_ids,
                        on_token=show, progress=lambda n: bars and bars[0].update(n), before_prefill=before_prefill)
    finally:
        for bar in bars:
            bar.close()
    if not speaker:
        return
    result, engine, spec, plan, method = done.result, done.engine, done.run.spec, done.run.plan, done.method
    if ended_at_once(lm, result, r.as_chat):
        print("note: the model ended its answer at once. It has a chat template: an instruction model "
              "expects its prompt in that template; try --chat", file=sys.stderr)
    summary = summary_of(runtime, done, world)
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
