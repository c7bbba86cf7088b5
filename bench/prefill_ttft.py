"""What a user does first with a long document: prefill it through the real offloaded path, then
decode. Prints the time to the first new token, the prefill alone, the host KV bytes moved each
way, and peak GPU memory against the plan.

    triforce bench prefill --arch llama2-7b-128k --context 32768 --profile rtx4090-24g \
        --dtype bfloat16 --json

The prompt is random token ids (prefill time does not depend on the values; a random-weight
architecture has no text to read anyway); --acceptance-trace makes the decoding after it accept
drafts as natural text did. The first tokens are timed one by one (where an answer's start goes).
The runtime is the one `generate` builds (plan, cache, engine, graphs), so the path is the user's;
--method picks what decodes after the prefill.
A GPU campaign step (gpu_campaign's prefill-32k and prefill-127k); on a CPU, --device-budget
makes a small architecture offload for a reduced run."""
from __future__ import annotations

import time
from contextlib import contextmanager, nullcontext

import click
import torch

from triforce.bench.harness import emit, output_option
from triforce.config import SamplingParams


# where a CPU prefill's time goes, by the profiler's operator names (self time, summed)
ATTENTION_OPS = ("scaled_dot_product", "flash_attention", "_efficient_attention", "triforce::cpu_attention")
PROJECTION_OPS = ("aten::mm", "aten::addmm", "aten::linear", "aten::bmm")


def op_seconds(events) -> dict:
    """The profiler's self CPU seconds split into attention (torch's kernels and our CPU one, which
    labelled_cpu_attention names to the profiler), projections (GEMMs) and the rest (norms, RoPE,
    copies; other numba kernels, which the profiler does not see, are the wall time's rest)."""
    parts = {"attention_s": 0.0, "projections_s": 0.0, "other_ops_s": 0.0}
    for e in events:
        part = ("attention_s" if any(n in e.key for n in ATTENTION_OPS)
                else "projections_s" if e.key in PROJECTION_OPS else "other_ops_s")
        parts[part] += e.self_cpu_time_total / 1e6
    return {k: round(v, 4) for k, v in parts.items()}


# where a GPU prefill's time goes, by kernel name (lower case; the profiler's CUDA activity only)
KERNEL_KINDS = (("copies_h2d_s", ("memcpy htod",)), ("copies_d2h_s", ("memcpy dtoh",)),
                ("attention_s", ("flash", "fmha", "attention", "softmax")),
                ("projections_s", ("gemm", "gemv", "nvjet", "cutlass", "xmma", "matmul", "splitk")))


def device_seconds(events, wall_s: float) -> dict:
    """The CUDA profiler's device time: attention, projections and other kernels, copies each way
    (on their own streams, so they may overlap the kernels), and the wall time no kernel ran in
    (the device waiting for the host: launches, syncs, copies it could not overlap)."""
    from torch.autograd import DeviceType

    parts = {kind: 0.0 for kind, _ in KERNEL_KINDS} | {"other_kernels_s": 0.0}
    seen = 0
    for e in events:
        if e.device_type != DeviceType.CUDA:
            continue
        seen += 1
        name = e.key.lower()
        kind = next((k for k, marks in KERNEL_KINDS if any(m in name for m in marks)), "other_kernels_s")
        parts[kind] += e.self_device_time_total / 1e6
    kernels = parts["attention_s"] + parts["projections_s"] + parts["other_kernels_s"]
    return {**{k: round(v, 4) for k, v in parts.items()}, "no_kernel_s": round(max(wall_s - kernels, 0.0), 4),
            "kernel_kinds_seen": seen}  # 0: the profiler recorded no device activity (no CUPTI, a simulated card)


@contextmanager
def labelled_cpu_attention():
    """Our CPU attention kernel (numba: invisible to torch's profiler) as a profiler range."""
    from triforce.kernels.cpu.attention import decode

    kernel = decode.attention

    def labelled(*args, **kwargs):
        with torch.profiler.record_function("triforce::cpu_attention"):
            return kernel(*args, **kwargs)

    decode.attention = labelled
    try:
        yield
    finally:
        decode.attention = kernel


def measure(runtime, context: int, new_tokens: int, seed: int = 0, breakdown: bool = False, trace=None) -> dict:
    """Prefill `context` random ids through runtime's engine, then decode `new_tokens` (trace: an
    acceptance trace the drafts replay, as text would be accepted; random ids draft nothing).
    breakdown: the prefill under torch's profiler, its time split by op_seconds (CPU) or device_seconds (CUDA)."""
    from triforce.decoding.acceptance_trace import ReplayVerifier

    lm = runtime.lm
    cuda = lm.device.type == "cuda"
    run = runtime.plan(context + new_tokens + 1)
    replay = ReplayVerifier(trace) if trace is not None and run.spec.method != "ar" else None
    engine = runtime.engine(context + new_tokens + 1, run, replay=replay)
    ids = torch.randint(0, lm.config.vocab_size, (context,), generator=torch.Generator().manual_seed(seed)).tolist()
    cache = engine.full.cache
    prefetcher = getattr(cache, "prefetcher", None)
    if cuda:
        torch.cuda.synchronize(lm.device)
        torch.cuda.reset_peak_memory_stats(lm.device)
    # on a GPU only the device's activity: a 32K prefill launches ~20K kernels, CPU ops would triple the events;
    # a torch without CUDA's profiler (a simulated card) refuses an empty list: its CPU ops then, and no kernel seen
    device_activity = torch.profiler.ProfilerActivity.CUDA
    activities = [device_activity if cuda and device_activity in torch.profiler.supported_activities()
                  else torch.profiler.ProfilerActivity.CPU]
    profiler = torch.profiler.profile(activities=activities) if breakdown else nullcontext()
    started = time.perf_counter()
    with profiler, labelled_cpu_attention() if breakdown else nullcontext():
        engine.set_sequence(ids)
        if cuda:
            torch.cuda.synchronize(lm.device)
    prefill_s = time.perf_counter() - started
    first = engine.generate(1, SamplingParams())
    ttft_s = time.perf_counter() - started
    parts = {}  # after the first token: its tally is no prefill's
    if breakdown:
        events = profiler.key_averages()
        parts = device_seconds(events, prefill_s) if cuda else op_seconds(events)
    marks = [time.perf_counter()]  # each token's arrival on the host: a round's tokens come together
    rest = engine.generate(new_tokens, SamplingParams(), on_token=lambda _: marks.append(time.perf_counter())) \
        if new_tokens else None
    plan = run.plan
    return {
        "context": context, "ttft_s": round(ttft_s, 3), "prefill_s": round(prefill_s, 3),
        "prefill_tokens_per_s": round(context / prefill_s, 1) if prefill_s else None,
        "first_token": first.tokens[:1],
        # the first token beyond the prefill: before its decoding began (graph captures, tiers
        # built) and its decoding, by tier
        "first_token_parts": {"before_decoding_s": round(ttft_s - prefill_s - first.time_s, 3),
                              "decoding_s": round(first.time_s, 3), "tier_time_s": first.stats.get("tier_time_s")},
        "decode_ms_per_token": round(1000 * rest.time_s / len(rest.tokens), 2) if rest and rest.tokens else None,
        "token_gaps_ms": [round(1000 * (b - a), 1) for a, b in zip(marks, marks[1:])],
        "decode_tier_time_s": rest.stats.get("tier_time_s") if rest else None,
        "replayed": replay is not None,
        "h2d_bytes": prefetcher.stats.h2d_bytes if prefetcher else 0,
        "d2h_bytes": prefetcher.stats.d2h_bytes if prefetcher else 0,
        "offloaded": plan.offloaded, "resident_tokens": plan.resident_tokens,
        "peak_gpu_bytes": torch.cuda.max_memory_allocated(lm.device) if cuda else None,
        "plan_gpu_bytes": plan.gpu_bytes_total, "prefill_chunk": plan.prefill_chunk,
        "prefill_group": plan.prefill_group, **parts,
    }


@click.command()
@click.option("--arch", default="llama2-7b-128k", show_default=True, help="A named architecture (random weights).")
@click.option("--model", default=None, help="A model to load instead of --arch ('default': the default model).")
@click.option("--max-context", type=int, default=None, help="With --rope-scaling: stretch the model this far.")
@click.option("--rope-scaling", default=None)
@click.option("--breakdown", is_flag=True, help="Split the prefill's time into attention and projections "
              "(torch's profiler: slows it a little; on a GPU by kernel, with copies and the time no kernel ran).")
@click.option("--context", type=int, required=True, help="Prompt tokens to prefill.")
@click.option("--new-tokens", type=int, default=8, show_default=True, help="Tokens decoded after the first.")
@click.option("--method", default="triforce", show_default=True, help="What decodes after the prefill (draft: lookup).")
@click.option("--acceptance-trace", default=None, type=click.Path(exists=True, dir_okay=False),
              help="Replay this trace's accept/reject decisions after the prefill (random ids draft nothing; "
                   "bench/traces/ holds traces recorded on natural text).")
@click.option("--profile", default=None, help="Memory profile (default: the device's).")
@click.option("--device-budget", default=None, help="GPU bytes to plan for (e.g. 2.5MB for a reduced CPU run).")
@click.option("--dtype", default="auto", show_default=True)
@click.option("--device", default="auto", show_default=True)
@click.option("--quantize", default="auto", show_default=True,
              help="Projections as GGUF blocks: gguf runs a .gguf model's own (as `generate --quantize`).")
@output_option
def main(arch, model, max_context, rope_scaling, breakdown, context, new_tokens, method, acceptance_trace, profile,
         device_budget, dtype, device, quantize, fmt):
    """Time to first token of a long prompt prefilled through the offloaded path."""
    from triforce.app.runtime import build_runtime
    from triforce.config import RunConfig, SpecParams
    from triforce.decoding.acceptance_trace import load_trace
    from triforce.errors import UserError

    if context < 2 or new_tokens < 0:
        raise click.UsageError("--context must be >= 2 and --new-tokens >= 0")
    arch = None if model is not None else arch
    config = RunConfig(model=model, arch=arch, draft="lookup", spec=SpecParams(method=method), dtype=dtype,
                       device=device, profile=profile, device_budget=device_budget, max_context=max_context,
                       rope_scaling=rope_scaling, quantize=quantize)
    try:
        runtime = build_runtime(config)
        trace = load_trace(acceptance_trace) if acceptance_trace else None
        measured = measure(runtime, context, new_tokens, breakdown=breakdown, trace=trace)
    except UserError as e:
        raise click.ClickException(str(e)) from None
    result = {"arch": arch or runtime.lm.config.model_type, "model": model, "device": str(runtime.lm.device), "dtype": str(runtime.lm.dtype).removeprefix("torch."),
              "profile": runtime.profile.name, "method": method, "load_s": round(runtime.load_s, 2),
              "prompt": "random token ids", "acceptance_trace": acceptance_trace,
              "weights": runtime.lm.quantized["weights"] if runtime.lm.quantized else "float", **measured}

    def table():
        print(f"{model or arch} on {result['device']} ({result['profile']}): {context} tokens prefilled in "
              f"{result['prefill_s']} s ({result['prefill_tokens_per_s']} tok/s), first token after "
              f"{result['ttft_s']} s; host KV moved {result['h2d_bytes'] / 1e9:.2f} GB in, "
              f"{result['d2h_bytes'] / 1e9:.2f} GB out")
        parts = result["first_token_parts"]
        print(f"the first token: {parts['before_decoding_s']} s before its decoding began, {parts['decoding_s']} s "
              f"decoding; then {len(result['token_gaps_ms'])} tokens at {result['decode_ms_per_token']} ms each "
              f"({'replaying ' + acceptance_trace if acceptance_trace else 'no trace replayed'})")
        if breakdown and "no_kernel_s" in measured:
            from triforce.bench.campaign.report import device_split
            print(device_split(measured))
        elif breakdown:
            print(f"prefill by op (profiler self time): attention {measured['attention_s']} s, projections "
                  f"{measured['projections_s']} s, other torch ops {measured['other_ops_s']} s")

    emit(fmt, result, [measured], table)  # the row also stands at the top, where the campaign's report reads it

if __name__ == "__main__":
    main()
