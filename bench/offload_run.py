"""`triforce bench offload`'s run: every rank builds the runtime and times the same methods in
lockstep; rank 0 prints the table or the JSON and draws the plot (the command parses the flags:
triforce.cli.bench_cmd)."""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass

from triforce.config import RunConfig


@dataclass(frozen=True)
class BenchRequest:
    config: RunConfig
    context: int
    methods: tuple
    trace: dict | None
    trace_path: str | None
    new_tokens: int
    plot_path: str
    fmt: str  # table, json or csv
    repeats: int = 2
    size_gamma2: bool = False  # gamma2 chosen by the cost model for the trace's acceptance
    rows_path: str | None = None  # JSON lines appended as the run goes: its setting, then each method's row
    speculative_tokens: int = 64  # speculative rows time at least this many per window


def journal(path: str, line: dict) -> None:
    """Append one JSON line to `path` at once: a run killed later (a campaign's time limit) keeps it."""
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(line) + "\n")


def bench_rank(rank: int, world: int, request: BenchRequest) -> None:
    run_bench(request, rank, world)


def measure_hybrid_rates(runtime, h2d: float) -> dict | None:
    """On a card whose profile has host attention rates: this machine's link and CPU measured now,
    which the hybrid split then follows (not the profile's nominal rates); None elsewhere."""
    if runtime.lm.device.type != "cuda" or runtime.profile.host_attention_gbps is None:
        return None
    from dataclasses import replace

    from triforce.plan.measure import host_attention_rates
    cpu_gbps, cpu_tflops = host_attention_rates(runtime.lm.dtype)
    rates = {"pcie_h2d_gbps": round(h2d, 2), "host_attention_gbps": round(cpu_gbps, 2),
             "host_attention_tflops": round(cpu_tflops, 3)}
    runtime.profile = replace(runtime.profile, **rates)
    return rates


def capped_to_profile(c, rank: int, world: int):
    """The run's profile; on a card, the memory this process may use capped to the profile's
    card before anything is allocated (an H200 stands in for a 24 GB one)."""
    import torch

    from triforce.app.parallel import rank_device
    from triforce.app.plan_and_cache import resolve_profile
    from triforce.model.loading import resolve_device

    torch_device = resolve_device(rank_device(c.device, rank) if world > 1 else c.device)
    prof = resolve_profile(c.profile, torch_device, c.device_budget)
    if torch_device.type == "cuda":
        total = torch.cuda.get_device_properties(torch_device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, prof.gpu_bytes / total), torch_device)
    return prof


def run_bench(r: BenchRequest, rank: int = 0, world: int = 1) -> None:
    """Every rank times the same steps in lockstep; rank 0 reports."""
    from triforce.app.runtime import build_runtime
    from triforce.bench.offload_bench import Setup, measure_h2d_gbps, run_method

    c = r.config
    prof = capped_to_profile(c, rank, world)
    runtime = build_runtime(c, rank, world)
    lm = runtime.lm
    name = f"{c.arch} (random weights)" if c.arch is not None else lm.path.name
    runtime.say_attention()
    h2d = measure_h2d_gbps(lm.device)
    measured_rates = measure_hybrid_rates(runtime, h2d)
    prompt_ids = None
    if c.model is not None and r.trace is None:  # a model's own acceptance needs its real KV; a replay does not
        from triforce.app.evaluation import needle_prompt
        prompt_ids = lm.tokenizer(needle_prompt(lm.tokenizer, r.context).text).input_ids
    spec = c.spec
    if r.size_gamma2:
        from dataclasses import replace

        from triforce.bench.offload_bench import sized_gamma2
        spec = replace(spec, gamma2=sized_gamma2(runtime, r.context, spec, r.trace))
    setup = Setup(runtime, prof, len(prompt_ids) if prompt_ids else r.context, r.new_tokens, spec, r.trace,
                  overlap=c.overlap, prompt_ids=prompt_ids, repeats=r.repeats, speculative_tokens=r.speculative_tokens)
    setup.arena, shared_note = shared_host_store(setup, r.methods)
    rows = []
    streamed = r.rows_path is not None and rank == 0  # a run cut short keeps what it measured
    from triforce.bench.harness import emit, provenance

    predicted, by_method = predicted_on_a_4090(r, runtime)
    auto = auto_choice(runtime, r.context, spec)
    if streamed:
        journal(r.rows_path, {"bench": "offload", "context": r.context, "profile": prof.name,
                              "pinned_h2d_gbps": round(h2d, 2), "provenance": provenance(),
                              "replayed_trace": r.trace_path, "host_store": shared_note, "predicted_4090": predicted,
                              "auto_choice": auto})
    for method in r.methods:
        if rank == 0:
            print(f"timing {method} ...", file=sys.stderr)
        rows.append(run_method(method, setup))
        if method in by_method:
            rows[-1]["predicted_4090_ms_per_token"] = by_method[method]
        if streamed:
            journal(r.rows_path, {"row": rows[-1]})
    if rank != 0:
        return
    title = f"{name}, context {r.context}, {str(lm.dtype).removeprefix('torch.')} on {lm.device}, {prof.name}" \
        + (f", tp {world}" if world > 1 else "")
    plotted = write_plot(rows, h2d, title, r.plot_path)
    out = {"model": name, "context": r.context, "device": str(lm.device), "profile": prof.name, "tp": world,
           "repeats": r.repeats, "hybrid_rates_measured": measured_rates,
           "kv_source": "a prefill of a real prompt" if prompt_ids else "random values (decode time does not depend on them)",
           "pinned_h2d_gbps": round(h2d, 2), "replayed_trace": r.trace_path, "host_store": shared_note,
           "predicted_4090": predicted, "auto_choice": auto, "plot": r.plot_path if plotted else None, "attention": runtime.attn_name, "graphs": c.graphs,
           "spec": {"budget": spec.budget, "gamma1": spec.gamma1, "gamma2": spec.gamma2,
                    "gamma2_sized_by_cost_model": r.size_gamma2}}
    emit(r.fmt, out, rows, lambda: print_table({**out, "rows": rows}, title, lm.device.type, plotted))


def predicted_on_a_4090(r, runtime) -> tuple[str, dict]:
    """Each method's ms/token as the cost model predicts it for this model and context on an RTX
    4090 (its profile's 25 GB/s link), to stand beside the measured one: (what the prediction is,
    or why there is none; ms/token by method)."""
    if r.trace is None:
        return "none: the acceptance is the model's own, not a trace's", {}
    from triforce.bench.offload_predictions import predict
    from triforce.plan.profiles import load_profile

    profile = load_profile(PREDICTED_PROFILE)
    found = predict(PREDICTED_PROFILE, None, r.context, r.trace, model=runtime.lm.config,
                    dtype_bytes=runtime.lm.dtype.itemsize, weights=runtime.plan_weights())
    if "error" in found:
        return f"none: on {PREDICTED_PROFILE} {found['error']}", {}
    return (f"predicted by the cost model on {PREDICTED_PROFILE} ({profile.pcie_h2d_gbps:g} GB/s host-to-device, "
            f"its nominal CPU rates), this model and context"), found["by_method"]


PREDICTED_PROFILE = "rtx4090-24g"


def auto_choice(runtime, context: int, spec) -> dict | None:
    """What `--method auto` runs at this context on this run's plan (the rows of that method are
    its measured speed), with the cost model's ms/token by method; None where no method fits."""
    from dataclasses import replace

    from triforce.errors import UserError

    try:
        choice = runtime.plan(context, replace(spec, method="auto")).auto
    except UserError:
        return None
    return None if choice is None else {**choice.to_json(), "said": choice.describe()}


def shared_host_store(setup, methods) -> tuple[object, str]:
    """One host buffer, allocated, pinned and filled once, that every method's host KV store borrows
    in turn (at 127K a 7B model's is 62 GiB); (None, why) where one would not help or fit."""
    from triforce.bench.offload_bench import host_store_bytes
    from triforce.pinned import HostArena, HostCapacityError

    sizes = [host_store_bytes(m, setup) for m in methods]
    need = max(sizes, default=0)
    if sum(size > 0 for size in sizes) < 2:
        return None, "one per method (fewer than two methods keep KV on the host)"
    try:
        arena = HostArena(need, pin=setup.lm.device.type == "cuda", budget_bytes=setup.profile.host_bytes)
    except HostCapacityError as e:
        return None, f"one per method (a shared one did not fit: {e})"
    from triforce.plan.profiles import format_size

    return arena, f"shared by the methods: {format_size(need)} allocated, pinned and filled once"


def print_table(out: dict, title: str, device_type: str, plotted: bool) -> None:
    from triforce.plan.profiles import format_size

    rows = out["rows"]
    print(title)
    kind = "pinned host-to-device" if device_type == "cuda" else "host-to-'device' (a memcpy: no GPU)"
    print(f"{kind} bandwidth measured now: {out['pinned_h2d_gbps']:.2f} GB/s"
          f"{' (rank 0; each rank has its own link)' if out['tp'] > 1 else ''}")
    print(f"{'method':15s} {'ms/token':>10s} {'PCIe MB/tok':>12s} {'H2D GB/s':>9s} {'peak GPU':>11s} "
          f"{'plan':>11s} {'budget':>11s} {'4090 ms/tok*':>12s}")
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
              f"{format_size(r['budget_bytes']):>11s} {r.get('predicted_4090_ms_per_token') or '-':>12}")
    print(f"* {out['predicted_4090']}")
    tri = next((r for r in rows if r["method"] == "triforce" and "error" not in r), None)
    if tri is not None:
        source = f"replayed from {out['replayed_trace']}" if out["replayed_trace"] else "decided by the models themselves"
        print(f"triforce: {tri['tiers']}, {tri['mean_tokens_per_full_verify']} tokens per full verify, "
              f"accept/reject {source}")
        for other in rows:
            if other is not tri and "error" not in other:
                print(f"  {other['ms_per_token'] / tri['ms_per_token']:.2f}x faster than {other['method']}")
    print(f"plot: {out['plot']}" if plotted else "plot skipped: install matplotlib (pip install 'triforce[bench]')")


def write_plot(rows: list[dict], h2d_gbps: float, title: str, path: str) -> bool:
    """Bar chart of ms/token; False when matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    good = [r for r in rows if "ms_per_token" in r]
    fig, ax = plt.subplots(figsize=(6, 3.6))
    bars = ax.bar([r["method"] for r in good], [r["ms_per_token"] for r in good],
                  color=["#888888", "#bb8844", "#3366aa"][:len(good)])
    for bar, r in zip(bars, good):
        ax.annotate(f"{r['ms_per_token']:.1f}", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center", va="bottom", fontsize=9)
    ax.set_ylabel("ms per token")
    ax.set_title(f"{title}\nhost-to-device copy {h2d_gbps:.1f} GB/s measured in the same run", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
