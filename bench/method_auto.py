"""`--method auto` against `--method ar` (and against triforce forced on) across contexts, on this
machine, through the same runtime the CLI uses (profile, cost model, plan):

    triforce bench context --contexts 512,2048,4096,8000 --new-tokens 64

For each context a prose prompt is prefilled by every run (a cache handed from run to run would
have its last prompt token re-run by the sparse tiers' set-up, which in bfloat16 changes that
token's KV in the last bit); each run decodes `--new-tokens` greedy tokens (the same tokens for
every method: checked), or with `--sampling chat` samples them as chat does (temperature 0.2,
top-p 0.9, repeat penalty 1.1, unseeded: auto's check times its rounds), `chat-seeded` with seed 0
(each token drawn from the seed and its position: every method gives the same answer). Goal
(issue 15): auto never below 0.95x of ar, and clearly above it where speculation helps.
Every method is timed `--repeats` times in turn and keeps its best, so a noisy moment costs all;
its spread over the repeats is reported beside it. Runs of two methods lie minutes apart at 26K
(each prefills), and a VM's speed drifts more than auto's 5% in that time, so auto's row also
says how it ran against the ar steps it took itself in the same run (`auto_vs_its_ar_steps`: its
tokens at the mean of those steps' times, over its rounds' time; median over the repeats)."""
from __future__ import annotations

import json
import statistics
import sys
import time

import click

from triforce.app.texts import PROMPT_KINDS
from triforce.bench.harness import emit, markdown, output_option, spread


MIN_AR_STEPS = 8  # ar steps a run must take for its own ar rate to be read from them
NAMEABLE = ("gamma1", "gamma2", "budget", "chunk_size")  # speculation flags a --methods entry may name


def decode(runtime, ids: list[int], new_tokens: int, method: str, sampling=None):
    """(GenerationResult, RunPlan, Engine, its rounds' (speculated, tokens, seconds)) of one run of
    `method` after `ids` ('auto': the config's), greedy or as `sampling` says."""
    from dataclasses import replace

    from triforce.config import SamplingParams
    from triforce.decoding.observers import Observer

    class RoundClock(Observer):
        def __init__(self):
            self.rounds = []

        def committed(self, plan) -> None:
            self.rounds.append((plan.speculate, plan.emitted, plan.seconds))

    max_len = len(ids) + new_tokens
    name, named = method_and_flags(method)
    spec = None if name == "auto" else replace(runtime.config.spec, method=name, **named)
    run = runtime.plan(max_len, spec=spec, fixed=frozenset(named))
    engine, clock = runtime.engine(max_len, run), RoundClock()
    engine.observers.append(clock)
    started = time.perf_counter()
    engine.set_sequence(ids)
    print(f"{method}: {len(ids)} tokens prefilled in {time.perf_counter() - started:.0f} s", file=sys.stderr)
    result = engine.generate(new_tokens, sampling or SamplingParams(), frozenset())
    return result, run, engine, clock.rounds


def method_and_flags(method: str) -> tuple[str, dict[str, int]]:
    """`triforce:gamma1=4:gamma2=8` -> ("triforce", {"gamma1": 4, "gamma2": 8}): a method with
    speculation flags named as a user names them (kept as given, where the plain method lets the
    cost model choose them and the engine adapt them)."""
    name, *flags = method.split(":")
    named = {}
    for flag in flags:
        key, _, value = flag.partition("=")
        if key not in NAMEABLE or not value.isdigit():
            raise click.BadParameter(f"'{flag}' in '{method}': name one of {', '.join(NAMEABLE)} as KEY=N",
                                     param_hint="--methods")
        named[key] = int(value)
    return name, named


def against_its_ar_steps(rounds: list[tuple[bool, int, float]]) -> float | None:
    """A run's speed against the ar steps it took itself: its tokens at their mean time over the
    time its rounds took (None: fewer than MIN_AR_STEPS of them)."""
    steps = [seconds for speculated, tokens, seconds in rounds if not speculated and tokens == 1]
    if len(steps) < MIN_AR_STEPS:
        return None
    return sum(tokens for _, tokens, _ in rounds) * statistics.mean(steps) / sum(seconds for *_, seconds in rounds)


@click.command()
@click.option("--model", default="default", show_default=True, help="Hugging Face folder, .gguf file or 'default'.")
@click.option("--quantize", type=click.Choice(["auto", "gguf", "q8_0", "q4_0", "q4_1", "q4_k", "none"]),
              default="none", show_default=True,
              help="Weights as blocks (gguf: a .gguf file's own); none: float, as --dtype says.")
@click.option("--contexts", default="512,2048,4096,8000", show_default=True, help="Prompt lengths in tokens.")
@click.option("--new-tokens", type=int, default=64, show_default=True)
@click.option("--repeats", type=click.IntRange(1, 10), default=2, show_default=True)
@click.option("--methods", default="ar,auto,triforce", show_default=True,
              help="ar first: the others are compared with it. A method may name speculation flags, kept as "
                   "given: triforce:gamma1=4:gamma2=8 (gamma1, gamma2, budget, chunk_size).")
@click.option("--dtype", default="auto", show_default=True)
@click.option("--profile", default=None, help="Memory profile (default: cpu).")
@click.option("--max-context", type=int, default=None, help="With --rope-scaling: stretch the model this far.")
@click.option("--rope-scaling", default=None)
@click.option("--prompt", "prompt_kind", type=click.Choice(PROMPT_KINDS), default="natural",
              show_default=True, help="natural: text that never repeats itself (what users bring); held-out: "
                                      "docstrings of transformers, click and numba, in no shipped file (auto's "
                                      "check on text it has not seen); repeated: a passage repeated, a stated best "
                                      "case for speculation.")
@click.option("--sampling", type=click.Choice(["greedy", "chat", "chat-seeded"]), default="greedy", show_default=True,
              help="greedy: the same tokens from every method (checked); chat: chat's sampling defaults, unseeded "
                   "as chat draws; chat-seeded: the same with seed 0 (the same tokens from every method).")
@output_option
def main(model, quantize, contexts, new_tokens, repeats, methods, dtype, profile, max_context, rope_scaling, prompt_kind,
         sampling, fmt):
    """Speed by context on natural text: ar, auto and the methods, greedy or sampled as chat does."""
    from dataclasses import replace

    from triforce.app.runtime import build_runtime
    from triforce.config import CHAT_SAMPLING, RunConfig
    from triforce.app.texts import prompt_text
    from triforce.config import SpecParams

    config = RunConfig(model=model, quantize=quantize, spec=SpecParams(method="auto"), dtype=dtype, profile=profile, max_context=max_context,
                       rope_scaling=rope_scaling)
    runtime = build_runtime(config)
    tok = runtime.lm.tokenizer
    rows = []
    drawn = {"chat": CHAT_SAMPLING, "chat-seeded": replace(CHAT_SAMPLING, seed=0)}.get(sampling)  # None: greedy
    for method in methods.split(","):
        method_and_flags(method)  # a misspelt flag stops here, before any prefill
    for n in (int(c) for c in contexts.split(",")):
        ids = tok(prompt_text(prompt_kind, tok, n + 8), add_special_tokens=False).input_ids[:n - new_tokens]
        rates, tokens, row, paired = {}, {}, {"context": n, "prompt_tokens": len(ids)}, []
        for _ in range(repeats):
            for method in methods.split(","):
                result, run, engine, rounds = decode(runtime, ids, new_tokens, method, drawn)
                rates.setdefault(method, []).append(len(result.tokens) / result.time_s)
                tokens[method] = result.tokens
                if method == "auto":
                    row["auto"] = run.auto.to_json()
                    row["auto_tiers"] = engine.describe()
                    paired.append(against_its_ar_steps(rounds))
        first = methods.split(",")[0]
        best = {method: max(r) for method, r in rates.items()}
        for method, rate in best.items():
            row[f"{method}_tok_s"] = round(rate, 2)
            row[f"{method}_vs_{first}"] = round(rate / best[first], 3)
            row[f"{method}_spread"] = round(spread(rates[method]), 3)  # over its repeats
        if paired:
            row["auto_vs_its_ar_steps"] = None if None in paired else round(statistics.median(paired), 3)
        row["same_tokens"] = all(t == tokens[first] for t in tokens.values())  # sampled: equal only by chance
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)  # a run stopped later keeps what it measured
    summary = {"model": str(runtime.lm.path), "weights": runtime.lm.quantized["weights"] if runtime.lm.quantized else "float",
               "dtype": str(runtime.lm.dtype).removeprefix("torch."), "profile": runtime.profile.name,
               "text": prompt_kind, "new_tokens": new_tokens, "sampling": sampling}
    shown = [{k: v for k, v in r.items() if k not in ("auto", "auto_tiers")} for r in rows]
    emit(fmt, summary, rows, lambda: print(markdown(shown)))


if __name__ == "__main__":
    main()
