"""`triforce bench offload`: ar-offload vs zero-inference vs triforce, with the bandwidth
measured in the same run."""
from __future__ import annotations

import click

from triforce.bench.harness import output_option, remember_commit
from triforce.config import RunConfig
from triforce.cli.options import (INT, MODEL_FORMS, check_output_path, device_option, dtype_option, offload_options,
                                  quantize_option, runtime_options)
from triforce.errors import UserError
from triforce.model.context_stretch import KINDS


# the benchmarks that live in triforce.bench, run as `triforce bench NAME`: (module, command, help);
# each is imported only when run (they load torch), so `triforce bench --help` lists them at once
MODULE_BENCHES = {
    "attention": ("triforce.bench.cpu_attention", "main",
                  "CPU decoding and verify attention: our kernel against SDPA by rows and keys."),
    "context": ("triforce.bench.method_auto", "main",
               "Speed by context on natural text: ar, auto and the methods, same tokens."),
    "prefill": ("triforce.bench.prefill_ttft", "main",
               "Time to first token of a long prompt prefilled through the offloaded path."),
    "llamacpp": ("triforce.bench.vs_llamacpp", "main",
                "Against llama.cpp's llama-bench on the same GGUF files and depths."),
    "transformers": ("triforce.bench.vs_transformers", "main",
                    "Against transformers' generate: same model, prompt and tokens."),
    "serve-ttft": ("triforce.bench.serve_bench", "ttft",
                  "The server's time to first token over a conversation about a document."),
    "serve-load": ("triforce.bench.serve_bench", "load",
                  "The server's throughput with several clients at once against one by one."),
    "kernels": ("triforce.bench.quant_kernels", "main",
               "Block-weight kernels against the float matmul and the bytes floor."),
    "sampling": ("triforce.bench.sampling_steps", "main",
                 "A sampled token's steps outside the model: host loops against torch's operators."),
    "start": ("triforce.bench.start_time", "main",
              "How long `triforce chat` takes to its prompt: a first start, then later ones."),
    "campaign": ("triforce.bench.gpu_campaign", "main",
                 "The GPU campaign a lease runs, step by step (--dry-run: its plan, on any machine)."),
    "tiers": ("triforce.bench.tier_steps", "main",
             "Each tier's step time against its bytes floor, CUDA graphs on and off."),
}


class BenchGroup(click.Group):
    """The bench commands defined here, and MODULE_BENCHES loaded when one is run."""

    def list_commands(self, ctx):
        return sorted([*super().list_commands(ctx), *MODULE_BENCHES])

    def get_command(self, ctx, name):
        if name in MODULE_BENCHES:
            import importlib

            module, command, _ = MODULE_BENCHES[name]
            return getattr(importlib.import_module(module), command)
        return super().get_command(ctx, name)

    def format_commands(self, ctx, formatter):
        rows = [(name, self.commands[name].get_short_help_str(60) if name in self.commands else MODULE_BENCHES[name][2])
                for name in self.list_commands(ctx)]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


@click.group("bench", cls=BenchGroup)
def bench_group():
    """Benchmarks against baselines; every JSON records what it ran on (results: bench/RESULTS.md).
    Each runs on a CPU; `triforce bench NAME --help` explains its flags."""
    remember_commit()


@bench_group.command("offload")
@click.option("--arch", default=None, help="A named architecture with random weights (e.g. llama2-7b-128k, or a "
                                          "Hugging Face or Ollama name of one: Qwen/Qwen3-32B).")
@click.option("--model", default=None, help=f"A real model instead: {MODEL_FORMS}.")
@click.option("--context", type=INT, required=True,
              help="Tokens already in the KV cache when decoding starts (with --model: a needle prompt this long).")
@offload_options
@click.option("--methods", default="ar-offload,ar-hybrid,zero-inference,triforce", show_default=True,
              help="ar-offload: the paper's baseline (all host KV over PCIe each token); ar-hybrid: the CPU attends "
                   "its share in place (the stronger baseline); zero-inference: all attention on the CPU; triforce; "
                   "triforce-ahead: triforce drafting the next cycle during each verify (generate --draft-ahead); "
                   "triforce-no-hybrid, triforce-no-residency: triforce with one part off (every host block over "
                   "PCIe; no host blocks kept in the prefill's freed scratch); "
                   "transformers-offloaded: transformers' own offloaded cache (--arch only).")
@click.option("--acceptance-trace", default=None,
              help="Accept/reject sequence to replay in the triforce row (from generate --record-acceptance); "
                   "required with --arch: random weights cannot accept drafts honestly. With --model, the KV "
                   "is then random values instead of a prefill (decode time does not depend on them; "
                   "`bench prefill` times a prefill).")
@click.option("--draft", default=None,
              help="Tier-0 drafter: an architecture name, a model path or 'lookup' "
                   "(default: llama-68m with --arch, lookup with --model).")
@click.option("--new-tokens", type=INT, default=16, show_default=True,
              help="Tokens timed per method and window (speculative methods: at least --speculative-tokens, so "
                   "the window holds several full verifies and a rebuild).")
@click.option("--repeats", type=INT, default=2, show_default=True, help="Timed windows per method (the spread is reported).")
@click.option("--speculative-tokens", type=INT, default=64, show_default=True,
              help="Speculative methods time at least this many tokens per window.")
@click.option("--budget", type=INT, default=None, help="Retrieval budget (default: the trace's, else 4096).")
@click.option("--gamma1", type=INT, default=None, help="Default: the trace's, else 2.")
@click.option("--gamma2", type=INT, default=None,
              help="Default: with a trace, what the cost model picks for its acceptance on this plan (at most the "
                   "trace's, which a replay cannot exceed); else 6.")
@click.option("--no-overlap", is_flag=True, help="Use the plain (non-overlapped) copy schedule.")
@click.option("--plot", "plot_path", default="offload-bench.png", show_default=True, help="PNG to write.")
@dtype_option
@quantize_option
@device_option
@click.option("--rope-scaling", type=click.Choice(KINDS), default=None,
              help="Stretch the model's RoPE past its trained context to hold --context plus --new-tokens.")
@click.option("--tp", type=INT, default=1, show_default=True,
              help="Tensor-parallel ranks: each GPU streams its own heads' KV over its own link.")
@runtime_options(count_syncs=False)
@output_option
@click.option("--rows-file", default=None,
              help="Append JSON lines to this file as the run goes: the setting, then each method's row the "
                   "moment it is timed (a run cut short keeps what it measured).")
def offload(arch, model, context, profile, device_budget, methods, acceptance_trace, draft, new_tokens, repeats,
            speculative_tokens, budget,
            gamma1, gamma2, no_overlap, plot_path, dtype, quantize, device, rope_scaling, tp, attn, no_graphs, threads, fmt,
            rows_file):
    """Time ms/token of offloaded decoding methods at a context length, on a budget.

    On CUDA the card is emulated with set_per_process_memory_fraction (the profile's gpu_bytes);
    peak GPU memory is reported against the plan and the budget.
    """
    from triforce.decoding.acceptance_trace import load_trace
    from triforce.bench.offload_bench import METHODS, SPECULATIVE
    from triforce.config import SpecParams

    chosen = tuple(m.strip() for m in methods.split(",") if m.strip())
    unknown = [m for m in chosen if m not in METHODS]
    if unknown or not chosen:
        raise UserError(f"unknown methods {unknown or methods!r} (choose from {', '.join(METHODS)})")
    if (arch is None) == (model is None):
        raise UserError("give exactly one of --arch and --model")
    if arch is not None:
        from triforce.model.architectures import arch_name
        arch = arch_name(arch)
    if context < 2 or new_tokens < 1 or tp < 1 or repeats < 1 or speculative_tokens < 1:
        raise UserError("--context must be >= 2, --new-tokens, --speculative-tokens, --repeats and --tp >= 1")
    if quantize not in ("auto", "none") and "transformers-offloaded" in chosen:
        raise UserError("transformers-offloaded runs transformers' own float model: leave it out with --quantize")
    check_output_path("--plot", plot_path)
    if rows_file is not None:
        check_output_path("--rows-file", rows_file)
    trace = load_trace(acceptance_trace) if acceptance_trace else None
    if arch is not None and set(SPECULATIVE) & set(chosen) and trace is None:
        raise UserError("random weights cannot accept drafts honestly: record a trace with "
                        "`triforce generate --method triforce ... --record-acceptance FILE` and pass "
                        "--acceptance-trace FILE")
    meta = trace or {}
    spec = SpecParams(method="triforce", budget=budget or meta.get("budget", 4096),
                      gamma1=gamma1 or meta.get("gamma1", 2), gamma2=gamma2 or meta.get("gamma2", 6),
                      chunk_size=meta.get("chunk_size", 8))
    config = RunConfig(model=model, arch=arch, draft=draft or ("llama-68m" if arch is not None else "lookup"),
                       spec=spec, dtype=dtype, quantize=quantize, device=device, profile=profile, device_budget=device_budget, attn=attn,
                       graphs="off" if no_graphs else "auto", overlap=not no_overlap,
                       max_context=context + 2 + max(new_tokens, speculative_tokens) * repeats + 26 if rope_scaling else None,
                       rope_scaling=rope_scaling, threads=threads)
    from triforce.app.parallel import run_on_ranks
    from triforce.bench.offload_run import BenchRequest, bench_rank

    request = BenchRequest(config, context, chosen, trace, acceptance_trace, new_tokens, plot_path, fmt, repeats,
                           size_gamma2=gamma2 is None and trace is not None, rows_path=rows_file,
                           speculative_tokens=speculative_tokens)
    run_on_ranks(tp, bench_rank, request, model, device, arch)
