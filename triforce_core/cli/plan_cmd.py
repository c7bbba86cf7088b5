"""`triforce plan`: where every byte goes for a model, a profile and a context length."""
from __future__ import annotations

import json

import click

from triforce.cli.options import INT, MODEL_FORMS, offload_options, speculation_options
from triforce.errors import UserError


def _model_shape(model: str | None, arch: str | None):
    if (model is None) == (arch is None):
        raise UserError("give exactly one of --model and --arch")
    if arch is not None:
        from triforce.model.architectures import arch_config, arch_name
        arch = arch_name(arch)
        return arch_config(arch), f"{arch} (shapes only)"
    from triforce.model.loading import model_shape

    shape, folder = model_shape(model)
    return shape, str(folder)


def _file_blocks(model: str, shape, dtype_bytes: int):
    """What a CPU run of a .gguf model holds under --quantize auto (None: floats, as it runs them)."""
    from triforce.app.runtime import auto_blocks_file

    path = auto_blocks_file(model)
    if path is None:
        return None
    from triforce.model.quantized import held_file_blocks
    from triforce.offload.shapes import LoadedBlocks, matrix_weights

    held = held_file_blocks(path, shape, dtype_bytes)
    return None if held is None else LoadedBlocks(held[0], held[1] / matrix_weights(shape))


def _draft_shape(draft: str | None):
    if draft in (None, "lookup", "none"):
        return None
    from triforce.model.architectures import ARCHITECTURES
    if draft in ARCHITECTURES:
        return _model_shape(None, draft)[0]
    return _model_shape(draft, None)[0]


def _acceptance(text: str | None, profile):
    from triforce.plan.cost_model import Acceptance
    if text is None:
        from triforce.plan.method_choice import default_acceptance
        return default_acceptance(profile)
    try:
        values = [float(v) for v in text.split(",")]
    except ValueError:
        raise UserError(f"--acceptance must be FULL[,RETRIEVAL] numbers in [0, 1], got '{text}'") from None
    if len(values) not in (1, 2):
        raise UserError(f"--acceptance must be FULL[,RETRIEVAL], got '{text}'")
    return Acceptance(full=values[0], retrieval=values[-1] if len(values) == 2 else Acceptance().retrieval,
                      measured=True)


_DTYPE_BYTES = {"float32": 4, "float64": 8, "bfloat16": 2, "float16": 2}


def _profile(profile: str | None, host_memory: str | None, device_budget: str | None):
    """(profile, host memory) of plan's flags: a named profile with this host's (or --host-memory's)
    RAM, else this machine's own; --device-budget replaces its GPU bytes."""
    from triforce.plan import host_limits
    from triforce.plan.profiles import load_profile, parse_size

    host = host_limits.host_memory(host_memory)
    prof = host_limits.with_host(load_profile(profile), host) if profile else \
        host_limits.this_cpu(host if host_memory else None)
    if device_budget is not None:
        prof = prof.with_device_budget(parse_size(device_budget, "--device-budget"))
    return prof, host


def print_all(result, name, dtype, method, chosen, auto, batch, context: int, host_note: str | None) -> None:
    """The plan as a person reads it: auto's choice, the batch's table, the plan, the host note."""
    if auto is not None:
        print(auto.describe())
    if batch is not None:
        print_batch(batch, context)
    print_plan(result, name, dtype, method, chosen)
    if host_note:
        print(f"note: {host_note}")


@click.command()
@click.option("--model", default=None, help=f"The model (its shapes only): {MODEL_FORMS}.")
@click.option("--arch", default=None, help="A named architecture, e.g. llama3.1-8b, or its Hugging Face or Ollama "
                                          "name (meta-llama/Llama-3.1-8B-Instruct, qwen3:32b): shapes only.")
@click.option("--context", type=INT, required=True, help="Tokens the full KV cache must hold.")
@offload_options
@speculation_options(default_method="triforce")
@click.option("--tp", type=INT, default=1, show_default=True, help="Tensor-parallel GPUs (the KV splits by heads).")
@click.option("--dtype", type=click.Choice(["auto", *_DTYPE_BYTES]), default="auto", show_default=True,
              help="auto = bfloat16 for GPU profiles and on CPUs with native bfloat16, else float32.")
@click.option("--quantize", type=click.Choice(["auto", "none", "q8_0", "q4_0", "q4_1", "q4_k"]), default="auto",
              show_default=True,
              help="Count the target's matrices as GGUF blocks of this format (norms stay in --dtype, the draft "
                   "model float), as the kernels hold them: the CPU's numba kernels on a CPU profile, the Triton "
                   "kernels on a GPU profile (q4_k: 4.75 bits a weight there, 6 on a CPU). auto: what a run holds, "
                   "the file's own blocks for a .gguf model on a CPU (as generate's --quantize auto), else floats.")
@click.option("--acceptance", default=None,
              help="FULL[,RETRIEVAL] acceptance rates for the prediction (default: the profile's measured ones, "
                   "else what natural text gave the default model with prompt lookup: 0.90 per token at the full "
                   "tier, 0.16 of lookup drafts kept at the retrieval tier).")
@click.option("--batch-size", type=INT, default=None,
              help="Plan one row of a batch of this many sequences (they share the weights) and predict "
                   "each method's latency and throughput for the batch.")
@click.option("--host-memory", default=None,
              help="Plan for another machine with this much RAM (e.g. 64GB), instead of reading this one's "
                   "(available memory and its container's limit, less a margin of 10%, at least 2 GiB).")
@click.option("--json", "as_json", is_flag=True, help="Print the plan as one JSON object.")
def plan(model, arch, context, profile, device_budget, method, draft, budget, chunk_size, gamma1, gamma2,
         rebuild_stride, rebuild_threshold, tp, dtype, quantize, acceptance, batch_size, host_memory, as_json):
    """Plan memory: weights, caches, staging buffers and how much KV stays on each GPU.

    Pure arithmetic (no GPU needed). Exits non-zero, saying what to change, when the request
    cannot fit. Predictions assume memory-bound steps at the profile's bandwidths. With
    --batch-size B the plan is one row's when B rows share the device, and a table predicts
    ms per token per sequence and tokens/s of the batch for ar and each speculative method
    (MagicDec's analysis: see `triforce bench batch`).
    """
    from triforce.cli.options import build_spec
    from triforce.plan.speculation_choice import plan_with_choice

    if context < 1:
        raise UserError(f"--context must be >= 1, got {context}")
    shape, name = _model_shape(model, arch)
    spec, fixed = build_spec(method, budget, chunk_size, gamma1, gamma2, rebuild_stride, rebuild_threshold)
    prof, host = _profile(profile, host_memory, device_budget)
    dtype_auto = dtype == "auto"
    if dtype == "auto":
        from triforce.model.cpu_features import native_bf16
        dtype = "bfloat16" if prof.num_gpus > 0 or native_bf16() else "float32"
    auto = batch = None
    weights = None if quantize in ("none", "auto") else quantize
    if quantize == "auto" and model is not None and dtype_auto and prof.num_gpus == 0 and tp == 1 \
            and batch_size is None:
        weights = _file_blocks(model, shape, _DTYPE_BYTES[dtype])
    if batch_size is not None and weights is not None:
        raise UserError("--quantize is planned for one sequence so far; leave out --batch-size or --quantize")
    if batch_size is not None:
        batch, prof, spec, fixed = _batch(shape, prof, context, batch_size, spec, fixed, dtype, tp, draft)
        method = spec.method
    if spec.method == "auto":
        from triforce.plan.method_choice import choose_method
        auto, spec = choose_method(shape, prof, context, spec, fixed, dtype_bytes=_DTYPE_BYTES[dtype],
                                   draft=_draft_shape(draft), tp=tp, has_tier0=draft != "none",
                                   assumed=_acceptance(acceptance, prof), weights=weights)
        method = spec.method
    result, spec, choice = plan_with_choice(shape, prof, context, spec, fixed, dtype_bytes=_DTYPE_BYTES[dtype],
                                            draft=_draft_shape(draft) if spec.uses_draft else None, tp=tp,
                                            assumed=_acceptance(acceptance, prof),
                                            has_tier0=spec.uses_draft and draft != "none", weights=weights)
    chosen = {"budget": spec.budget, "chunk_size": spec.chunk_size, "gamma1": spec.gamma1, "gamma2": spec.gamma2,
              "gamma2_range": list(spec.gamma2_range),
              "chosen_by_cost_model": sorted({"budget", "chunk_size", "gamma1", "gamma2"} - fixed) if choice else []}
    limits = plan_limits(result, shape.max_position_embeddings, context)
    host_note = f"profile {prof.name}: {prof.description}" if prof.source == "this machine" else \
        None if prof.num_gpus == 0 else f"host memory: {host.describe()}"
    if as_json:
        print(json.dumps({"model": name, "dtype": dtype, "method": method, "speculation": chosen,
                          "method_choice": auto.to_json() if auto else None, "limits": limits, "host_note": host_note,
                          "batch": batch.to_json() if batch else None, **result.to_json()}))
    else:
        print_all(result, name, dtype, method, chosen, auto, batch, context, host_note)
    if limits:
        raise UserError("; ".join(limits) if len(limits) == 1 else
                        " ".join(f"({i}) {limit};" for i, limit in enumerate(limits, 1)).rstrip(";"))


def plan_limits(result, trained: int, context: int) -> list[str]:
    """Every limit the request passes, at once: the model's own context, then the memory."""
    limits = []
    if context > trained:
        limits.append(f"{context} tokens is past the model's {trained}-token context: run it with --max-context "
                      f"{context} --rope-scaling yarn (or ask for at most {trained})")
    if not result.feasible:
        limits.append(f"does not fit: {result.reason}")
    return limits


def _batch(shape, prof, context: int, rows: int, spec, fixed, dtype: str, tp: int, draft):
    """(BatchChoice, one row's profile, the spec and fixed flags to plan): auto takes the batch's pick."""
    from dataclasses import replace

    from triforce.plan.batch_choice import choose_for_batch, predict_batch, row_profile, spec_for

    if rows < 1:
        raise UserError(f"--batch-size must be >= 1, got {rows}")
    size = _DTYPE_BYTES[dtype]
    draft_shape = _draft_shape(draft)
    predictions = predict_batch(shape, prof, context, rows, replace(spec, method="ar"), dtype_bytes=size,
                                fixed=fixed, tp=tp)
    if not predictions:
        raise UserError(f"no method fits a batch of {rows} rows of {context} tokens in profile {prof.name}")
    choice = choose_for_batch(predictions)
    row = row_profile(shape, prof, rows, size, tp, draft=draft_shape if spec.uses_draft else None)
    if spec.method == "auto":
        return (choice, row, *spec_for(choice.chosen, spec, fixed))
    return choice, row, spec, fixed


def print_batch(choice, context: int) -> None:
    rows = choice.chosen.rows
    ar = next((p for p in choice.predictions if p.method == "ar"), None)
    print(f"batch of {rows} x {context} tokens, predicted (ms per token of each sequence, tok/s of the whole batch):")
    for p in choice.predictions:
        extra = "" if p.method == "ar" else (f"  budget {p.budget}, gamma2 {p.gamma2}, acceptance {p.acceptance}; "
                                             f"draft/target step {p.draft_to_target}, verify/decode {p.verify_to_decode}")
        ratio = f"{ar.ms_per_token / p.ms_per_token:5.2f}x" if ar else ""
        print(f"  {p.method:10s} {p.ms_per_token:9.2f} ms/token {p.tokens_per_s:10.1f} tok/s {ratio}{extra}")
    print(choice.describe())


def print_plan(result, name: str, dtype: str, method: str, chosen: dict) -> None:
    from triforce.plan.profiles import format_size as fmt

    weights = "" if result.weight_format is None else f" (weights as {result.weight_format} blocks)"
    print(f"plan: {name}, {dtype}{weights}, context {result.context} tokens, method {method}, tp {result.tp}, "
          f"profile {result.profile}")
    print(f"GPU memory per device (budget {fmt(result.gpu_budget_bytes)}):")
    for key, value in result.breakdown.items():
        print(f"  {key:18s} {fmt(value):>12s}")
    print(f"  {'total':18s} {fmt(result.gpu_bytes_total):>12s}")
    print("host memory:")
    for key, value in result.host_breakdown.items():
        print(f"  {key:18s} {fmt(value):>12s}")
    print(f"  {'total':18s} {fmt(result.host_bytes_total):>12s} of {fmt(result.host_budget_bytes)}")
    if not result.feasible:
        return
    if result.offloaded:
        print(f"KV: tokens 0..{result.resident_tokens} of every layer stay on the GPU, the other "
              f"{result.context - result.resident_tokens} stream from the host in blocks of "
              f"{result.block_tokens} tokens through two staging buffers")
        if result.decode_resident_tokens > result.resident_tokens:
            print(f"    once decoding starts, the prefill's scratch holds tokens up to {result.decode_resident_tokens} "
                  f"on the GPU (whole host blocks, copied once)")
    else:
        print("KV: the whole cache stays on the device (nothing offloaded)")
    p = result.predictions
    acc = p["acceptance"]
    # ar-hybrid (the CPU attends its share of the host KV in place) is the stronger baseline
    hybrid = f", ar-hybrid {p['ar_hybrid_ms_per_token']:.1f}" if "ar_hybrid_ms_per_token" in p else ""
    print(f"predicted: ar-offload {p['ar_offload_ms_per_token']:.1f}{hybrid} ms/token, triforce "
          f"{p['triforce_ms_per_token']:.1f} ms/token ({p['predicted_speedup']}x of ar-offload; "
          f"{p['expected_tokens_per_full_verify']} tokens per full verify at "
          f"{'measured' if acc['measured'] else 'assumed'} acceptance full {acc['full']}, "
          f"retrieval {acc['retrieval']})")
    if method != "ar":
        by_model = ", ".join(chosen["chosen_by_cost_model"]) or "none"
        low, high = chosen["gamma2_range"]
        print(f"speculation: budget {chosen['budget']}, chunk size {chosen['chunk_size']}, gamma1 {chosen['gamma1']}, "
              f"gamma2 {chosen['gamma2']}" + (f" (adapting within {low}..{high})" if low != high else "")
              + (f"; chosen by the cost model: {by_model}" if chosen["chosen_by_cost_model"] else
                 "; defaults (no measured acceptance: store `triforce eval acceptance --json` output with "
                 "`triforce profile tune --acceptance FILE`, or pass --acceptance)"))
