"""`triforce bench batch`: throughput and latency of ar, self-speculation and TriForce as the
batch grows (triforce.bench.batch_bench), measured here and predicted for GPUs."""
from __future__ import annotations

import platform
import sys

import click

from triforce.bench.harness import output_option
from triforce.cli.options import (INT, check_output_path, device_option, dtype_option, int_list, model_option,
                                  threads_option)
from triforce.errors import UserError

METHODS = ("ar", "streaming", "snapkv", "retrieval", "triforce")


@click.command("batch")
@model_option
@click.option("--contexts", default="2048,8192", show_default=True, help="Prompt tokens per sequence.")
@click.option("--batch-sizes", default="1,2,4,8", show_default=True, help="Sequences decoded together.")
@click.option("--methods", default="ar,streaming,snapkv,triforce", show_default=True,
              help=f"From {', '.join(METHODS)} (ar is needed for the ratios; triforce drafts by prompt lookup).")
@click.option("--new-tokens", type=INT, default=48, show_default=True, help="Greedy tokens per sequence.")
@click.option("--budget", type=INT, default=512, show_default=True, help="Draft KV tokens of the speculative methods.")
@dtype_option
@device_option
@click.option("--plot", "plot_path", default="batch-bench.png", show_default=True, help="PNG to write.")
@output_option
@threads_option
def batch(model, contexts, batch_sizes, methods, new_tokens, budget, dtype, device, plot_path, threads, fmt):
    """Decode batches of long prompts with each method, beside the cost model's prediction.

    MagicDec's claim: once a batch's KV outweighs the weights, self-speculation with a small draft
    KV raises throughput, more so as the batch grows. The table gives each (context, batch size,
    method) its batch tok/s, ms per token per sequence, the prediction and the ratio to ar; the
    crossover is the smallest batch from which speculation wins. A second table predicts the same
    for an RTX 4090 and an H100 (Llama-3.1-8B) at 32K-128K tokens.
    """
    chosen = [m.strip() for m in methods.split(",") if m.strip()]
    unknown = [m for m in chosen if m not in METHODS]
    if unknown or "ar" not in chosen:
        raise UserError(f"--methods takes ar and any of {', '.join(METHODS[1:])}, got {methods!r}")
    context_list = sorted(set(int_list(contexts, "--contexts")))
    size_list = sorted(set(int_list(batch_sizes, "--batch-sizes")))
    if new_tokens < 1 or budget < 1:
        raise UserError("--new-tokens and --budget must be >= 1")
    check_output_path("--plot", plot_path)
    from triforce.app.runtime import build_runtime
    from triforce.config import RunConfig
    from triforce.bench import batch_bench
    from triforce.config import SpecParams

    runtime = build_runtime(RunConfig(model=model, spec=SpecParams(method="auto"), dtype=dtype, device=device,
                                      threads=threads))
    limit = runtime.context
    if max(context_list) + new_tokens > limit:
        raise UserError(f"--contexts up to {max(context_list)} plus {new_tokens} new tokens exceed the model's "
                        f"{limit}-token context")
    log = (lambda text: print(text, file=sys.stderr))
    rows = batch_bench.measure(runtime, context_list, size_list, chosen, new_tokens, budget, log=log)
    crossover = batch_bench.crossovers(rows)
    gpu = batch_bench.gpu_predictions(size_list, budget)
    plotted = batch_bench.plot(rows, plot_path)
    from triforce.bench.harness import emit

    report = {"machine": f"{platform.machine()}, {runtime.profile.cpu_threads} threads", "model": str(runtime.lm.path),
              "dtype": str(runtime.lm.dtype).removeprefix("torch."), "new_tokens": new_tokens, "budget": budget,
              "crossover_batch_size": {str(k): v for k, v in crossover.items()},
              "gpu_predictions": gpu, "plot": plot_path if plotted else None}
    emit(fmt, report, rows, lambda: table(rows, crossover, gpu))
    if plotted:
        print(f"plot: {plot_path}", file=sys.stderr)


def table(rows: list[dict], crossover: dict, gpu: list[dict]) -> None:
    print("| context | batch | method | tok/s | ms/token/seq | predicted ms | x ar | predicted x ar | "
          "acceptance | tokens/verify |")
    print("|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['context']} | {r['batch_size']} | {r['method']} | {r['tokens_per_s']} | {r['ms_per_token']} | "
              f"{r['predicted_ms_per_token']} | {r.get('x_ar', '')} | {r.get('predicted_x_ar', '')} | "
              f"{r['acceptance'] if r['acceptance'] is not None else ''} | {r['tokens_per_verify'] or ''} |")
    for context, size in crossover.items():
        where = f"from batch size {size}" if size else "at none of the batch sizes measured"
        print(f"crossover at {context} tokens: speculation out-runs ar {where}")
    print("\npredicted (cost model, assumed acceptance), Llama-3.1-8B bfloat16:")
    print("| profile | context | batch | method | ms/token/seq | tok/s | x ar |")
    print("|---|---:|---:|---|---:|---:|---:|")
    for g in gpu:
        print(f"| {g['profile']} | {g['context']} | {g['batch_size']} | {g['method']} | {g['ms_per_token']} | "
              f"{g['tokens_per_s']} | {g['x_ar']} |")
