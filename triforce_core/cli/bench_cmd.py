"""`triforce bench offload`: ar-offload vs zero-inference vs triforce, with the bandwidth
measured in the same run."""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass

import click

from triforce.app.runtime import RunConfig
from triforce.cli.options import INT, check_output_path, device_option, dtype_option, offload_options, runtime_options
from triforce.errors import UserError
from triforce.model.context_stretch import KINDS


@click.group("bench")
def bench_group():
    """Benchmarks against baselines (results belong in bench/RESULTS.md)."""


@bench_group.command("offload")
@click.option("--arch", default=None, help="A named architecture with random weights (e.g. llama2-7b-128k).")
@click.option("--model", default=None, help="A real model instead (folder, .gguf or 'default').")
@click.option("--context", type=INT, required=True,
              help="Tokens already in the KV cache when decoding starts (with --model: a needle prompt this long).")
@offload_options
@click.option("--methods", default="ar-offload,ar-hybrid,zero-inference,triforce", show_default=True,
              help="ar-offload: the paper's baseline (all host KV over PCIe each token); ar-hybrid: the CPU attends "
                   "its share in place (the stronger baseline); zero-inference: all attention on the CPU; triforce.")
@click.option("--acceptance-trace", default=None,
              help="Accept/reject sequence to replay in the triforce row (from generate --record-acceptance); "
                   "required with --arch: random weights cannot accept drafts honestly.")
@click.option("--draft", default=None,
              help="Tier-0 drafter: an architecture name, a model path or 'lookup' "
                   "(default: llama-68m with --arch, lookup with --model).")
@click.option("--new-tokens", type=INT, default=16, show_default=True,
              help="Tokens timed per method and window (speculative methods: at least 64, so the window holds "
                   "several full verifies and a rebuild).")
@click.option("--repeats", type=INT, default=2, show_default=True, help="Timed windows per method (the spread is reported).")
@click.option("--budget", type=INT, default=None, help="Retrieval budget (default: the trace's, else 4096).")
@click.option("--gamma1", type=INT, default=None, help="Default: the trace's, else 2.")
@click.option("--gamma2", type=INT, default=None,
              help="Default: with a trace, what the cost model picks for its acceptance on this plan (at most the "
                   "trace's, which a replay cannot exceed); else 6.")
@click.option("--no-overlap", is_flag=True, help="Use the plain (non-overlapped) copy schedule.")
@click.option("--plot", "plot_path", default="offload-bench.png", show_default=True, help="PNG to write.")
@dtype_option
@device_option
@click.option("--rope-scaling", type=click.Choice(KINDS), default=None,
              help="Stretch the model's RoPE past its trained context to hold --context plus --new-tokens.")
@click.option("--tp", type=INT, default=1, show_default=True,
              help="Tensor-parallel ranks: each GPU streams its own heads' KV over its own link.")
@runtime_options(count_syncs=False)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def offload(arch, model, context, profile, device_budget, methods, acceptance_trace, draft, new_tokens, repeats, budget,
            gamma1, gamma2, no_overlap, plot_path, dtype, device, rope_scaling, tp, attn, no_graphs, as_json):
    """Time ms/token of offloaded decoding methods at a context length, on a budget.

    On CUDA the card is emulated with set_per_process_memory_fraction (the profile's gpu_bytes);
    peak GPU memory is reported against the plan and the budget.
    """
    from triforce.decoding.acceptance_trace import load_trace
    from triforce.bench.offload_bench import METHODS
    from triforce.config import SpecParams

    chosen = tuple(m.strip() for m in methods.split(",") if m.strip())
    unknown = [m for m in chosen if m not in METHODS]
    if unknown or not chosen:
        raise UserError(f"unknown methods {unknown or methods!r} (choose from {', '.join(METHODS)})")
    if (arch is None) == (model is None):
        raise UserError("give exactly one of --arch and --model")
    if context < 2 or new_tokens < 1 or tp < 1 or repeats < 1:
        raise UserError("--context must be >= 2, --new-tokens, --repeats and --tp >= 1")
    check_output_path("--plot", plot_path)
    trace = load_trace(acceptance_trace) if acceptance_trace else None
    if arch is not None and "triforce" in chosen and trace is None:
        raise UserError("random weights cannot accept drafts honestly: record a trace with "
                        "`triforce generate --method triforce ... --record-acceptance FILE` and pass "
                        "--acceptance-trace FILE")
    meta = trace or {}
    spec = SpecParams(method="triforce", budget=budget or meta.get("budget", 4096),
                      gamma1=gamma1 or meta.get("gamma1", 2), gamma2=gamma2 or meta.get("gamma2", 6),
                      chunk_size=meta.get("chunk_size", 8))
    config = RunConfig(model=model, arch=arch, draft=draft or ("llama-68m" if arch is not None else "lookup"),
                       spec=spec, dtype=dtype, device=device, profile=profile, device_budget=device_budget, attn=attn,
                       graphs="off" if no_graphs else "auto", overlap=not no_overlap,
                       max_context=context + 2 + max(new_tokens, 64) * repeats + 9 if rope_scaling else None,
                       rope_scaling=rope_scaling)
    request = BenchRequest(config, context, chosen, trace, acceptance_trace, new_tokens, plot_path, as_json, repeats,
                           size_gamma2=gamma2 is None and trace is not None)
    from triforce.app.parallel import run_on_ranks
    run_on_ranks(tp, bench_rank, request, model, device, arch)


@dataclass(frozen=True)
class BenchRequest:
    config: RunConfig
    context: int
    methods: tuple
    trace: dict | None
    trace_path: str | None
    new_tokens: int
    plot_path: str
    as_json: bool
    repeats: int = 2
    size_gamma2: bool = False  # gamma2 chosen by the cost model for the trace's acceptance


def bench_rank(rank: int, world: int, request: BenchRequest) -> None:
    run_bench(request, rank, world)


def run_bench(r: BenchRequest, rank: int = 0, world: int = 1) -> None:
    """Every rank times the same steps in lockstep; rank 0 reports."""
    import torch

    from triforce.app.parallel import rank_device
    from triforce.app.plan_and_cache import resolve_profile
    from triforce.app.runtime import build_runtime
    from triforce.bench.offload_bench import Setup, measure_h2d_gbps, run_method, write_plot
    from triforce.model.loading import resolve_device

    c = r.config
    torch_device = resolve_device(rank_device(c.device, rank) if world > 1 else c.device)
    prof = resolve_profile(c.profile, torch_device, c.device_budget)
    if torch_device.type == "cuda":  # emulate the profile's card before anything is allocated
        total = torch.cuda.get_device_properties(torch_device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, prof.gpu_bytes / total), torch_device)
    runtime = build_runtime(c, rank, world)
    lm = runtime.lm
    name = f"{c.arch} (random weights)" if c.arch is not None else lm.path.name
    runtime.say_attention()
    h2d = measure_h2d_gbps(lm.device)
    measured_rates = None
    if lm.device.type == "cuda" and runtime.profile.host_attention_gbps is not None:
        # the hybrid split follows this machine's link and CPU, measured now, not the profile's nominal rates
        from dataclasses import replace as with_rates

        from triforce.offload.measure import host_attention_rates
        cpu_gbps, cpu_tflops = host_attention_rates(lm.dtype)
        runtime.profile = with_rates(runtime.profile, pcie_h2d_gbps=round(h2d, 2), host_attention_gbps=round(cpu_gbps, 2),
                                     host_attention_tflops=round(cpu_tflops, 3))
        measured_rates = {"pcie_h2d_gbps": round(h2d, 2), "host_attention_gbps": round(cpu_gbps, 2),
                          "host_attention_tflops": round(cpu_tflops, 3)}
    prompt_ids = None
    if c.model is not None:  # a real model decodes after a real prompt, with its own acceptance
        from triforce.app.evaluation import needle_prompt
        prompt_ids = lm.tokenizer(needle_prompt(lm.tokenizer, r.context).text).input_ids
    spec = c.spec
    if r.size_gamma2:
        from dataclasses import replace

        from triforce.bench.offload_bench import sized_gamma2
        spec = replace(spec, gamma2=sized_gamma2(runtime, r.context, spec, r.trace))
    setup = Setup(runtime, prof, len(prompt_ids) if prompt_ids else r.context, r.new_tokens, spec, r.trace,
                  overlap=c.overlap, prompt_ids=prompt_ids, repeats=r.repeats)
    rows = []
    for method in r.methods:
        if rank == 0:
            print(f"timing {method} ...", file=sys.stderr)
        rows.append(run_method(method, setup))
    if rank != 0:
        return
    title = (f"{name}, context {r.context}, {str(lm.dtype).removeprefix('torch.')} on {lm.device}, {prof.name}"
             f"{', tp %d' % world if world > 1 else ''}")
    plotted = write_plot(rows, h2d, title, r.plot_path)
    from triforce.bench.provenance import git_commit

    out = {"model": name, "context": r.context, "device": str(lm.device), "profile": prof.name, "tp": world,
           "commit": git_commit(), "repeats": r.repeats, "hybrid_rates_measured": measured_rates,
           "pinned_h2d_gbps": round(h2d, 2), "rows": rows, "replayed_trace": r.trace_path,
           "plot": r.plot_path if plotted else None, "attention": runtime.attn_name, "graphs": c.graphs,
           "spec": {"budget": spec.budget, "gamma1": spec.gamma1, "gamma2": spec.gamma2,
                    "gamma2_sized_by_cost_model": r.size_gamma2}}
    if r.as_json:
        print(json.dumps(out))
        return
    print_table(out, title, lm.device.type, plotted)


def print_table(out: dict, title: str, device_type: str, plotted: bool) -> None:
    from triforce.offload.profiles import format_size

    rows = out["rows"]
    print(title)
    kind = "pinned host-to-device" if device_type == "cuda" else "host-to-'device' (a memcpy: no GPU)"
    print(f"{kind} bandwidth measured now: {out['pinned_h2d_gbps']:.2f} GB/s"
          f"{' (rank 0; each rank has its own link)' if out['tp'] > 1 else ''}")
    print(f"{'method':15s} {'ms/token':>10s} {'PCIe MB/tok':>12s} {'H2D GB/s':>9s} {'peak GPU':>11s} "
          f"{'plan':>11s} {'budget':>11s}")
    for r in rows:
        if "error" in r:
            print(f"{r['method']:15s} does not fit: {r['error']}")
            continue
        peak = format_size(r["peak_gpu_bytes"]) if r.get("peak_gpu_bytes") is not None else "n/a (CPU)"
        if "pcie_bytes_per_token" not in r:  # a peer timed by its own code: ms/token only
            print(f"{r['method']:15s} {r['ms_per_token']:10.2f} {'':>12s} {'':>9s} {peak:>11s}")
            continue
        print(f"{r['method']:15s} {r['ms_per_token']:10.2f} {r['pcie_bytes_per_token'] / 1e6:12.3f} "
              f"{r['achieved_h2d_gbps']:9.2f} {peak:>11s} {format_size(r['plan_gpu_bytes']):>11s} "
              f"{format_size(r['budget_bytes']):>11s}")
    tri = next((r for r in rows if r["method"] == "triforce" and "error" not in r), None)
    if tri is not None:
        source = f"replayed from {out['replayed_trace']}" if out["replayed_trace"] else "decided by the models themselves"
        print(f"triforce: {tri['tiers']}, {tri['mean_tokens_per_full_verify']} tokens per full verify, "
              f"accept/reject {source}")
        for other in rows:
            if other is not tri and "error" not in other:
                print(f"  {other['ms_per_token'] / tri['ms_per_token']:.2f}x faster than {other['method']}")
    print(f"plot: {out['plot']}" if plotted else "plot skipped: install matplotlib (pip install 'triforce[bench]')")
