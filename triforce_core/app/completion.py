"""The one path from a prompt's token ids to new tokens, shared by triforce.LLM (and through it
`triforce generate`): encode, check the room, plan for the prompt and its answer, build the
engine, prefill (the caller decodes); and the summary `generate --json` prints."""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass

from triforce.app.inputs import text_bound
from triforce.app.threads import threads_in_use
from triforce.decoding.numerics import SYMPTOMS, located
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
    engine_s: float = 0.0  # building the engine: its caches, tiers and the drafting tiers' graphs captured
    engine_reused: bool = False  # the last request's engine served this one (Runtime.kept_engine)
    prefilled: int = 0           # prompt tokens prefilled (the rest was cached by the last request)

    @property
    def method(self) -> str:
        """The method that decoded: auto's gate may have kept every token on ar."""
        if self.run.auto is not None and self.result.stats.get("auto_ar_tokens", 0) >= len(self.result.tokens) > 0:
            return "ar"
        return self.run.spec.method


@dataclass
class Prefilled:
    """A request's engine, built or kept, with the prompt in its caches."""
    ids: list[int]
    run: object
    engine: object
    reused: bool
    engine_s: float
    prefill_s: float
    started: float  # perf_counter when the prefill began
    prefilled: int

    def completion(self, result) -> Completion:
        """The Completion of this prompt decoded to `result` (Engine.generate's)."""
        return Completion(self.ids, result, self.run, self.engine, self.prefill_s, time.perf_counter() - self.started,
                          self.engine_s, self.reused, self.prefilled)


@contextmanager
def prefilled(runtime, ids: list[int], max_new_tokens: int, *, progress=None, before_prefill=None):
    """Plan for the prompt and its new tokens, build (or keep) the engine, prefill: the path from
    token ids to an engine ready to decode, of `triforce generate` and of triforce.LLM, which
    decode inside the block (their own call of Engine.generate: one frame fewer between the
    command and the acceptance test, docs/ARCHITECTURE.md). A numerical failure in the block names
    its layer; any failure drops the engine, which the next request must not trust."""
    max_len = len(ids) + max(max_new_tokens, 1)
    built = time.perf_counter()
    run, engine, reused = runtime.kept_engine(max_len)
    engine_s = time.perf_counter() - built
    try:
        if before_prefill is not None:
            before_prefill(run)
        kept = len(ids) - 1 - engine.tokens_to_prefill(ids)  # the cached prefix of a prompt seen before
        if kept and progress is not None:
            progress(kept)
        started = time.perf_counter()
        count = engine.set_sequence(ids, progress)
        try:
            yield Prefilled(ids, run, engine, reused, engine_s, time.perf_counter() - started, started, count)
        except SYMPTOMS as e:
            raise located(e, runtime.lm, engine.seq) from None
    except BaseException:
        runtime.drop_engine()
        raise


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
        "engine_s": round(c.engine_s, 4),  # before time_s: the engine built, its graphs captured
        "engine_reused": c.engine_reused,
        "cached_tokens": len(c.ids) - 1 - c.prefilled,  # KV the last request left (vLLM's num_cached_tokens)
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


