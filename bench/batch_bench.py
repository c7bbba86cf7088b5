"""`triforce bench batch`: batches of long prompts decoded by ar, self-speculation (StreamingLLM,
SnapKV, retrieval drafts) and TriForce (prompt lookup), with the cost model's prediction beside
each measurement (MagicDec's experiment on this machine), and the same table predicted for GPUs.

Every row is a different stretch of prose of the context's length; each row's prompt is
prefilled once and its cache handed from method to method. Each method runs with the budget
given and the gammas the cost model picks for that batch. Throughput is the batch's new tokens
per second; latency the ms per token of a sequence (each row's decoding time over its tokens)."""
from __future__ import annotations

import sys
import time
from dataclasses import replace

from triforce.app.batch_generate import generate_batch, row_models, row_plan
from triforce.app.batch_tally import batch_summary
from triforce.app.texts import natural_ids, natural_size
from triforce.config import SamplingParams, SpecParams
from triforce.decoding.full_tier import FullTier
from triforce.plan.batch_choice import BatchPrediction, predict_batch, spec_for

GPU_PREDICTIONS = (("rtx4090-24g", "llama3.1-8b"), ("h100-80g", "llama3.1-8b"))
GPU_CONTEXTS = (32768, 65536, 131072)


def prose_rows(tokenizer, context: int, rows: int) -> list[list[int]]:
    """`rows` prompts of `context` tokens of natural text, each from a different part of the
    corpus (they overlap only where the corpus is too short for disjoint rows)."""
    stride = min(context, max(1, (natural_size(tokenizer) - context) // max(rows - 1, 1)))
    return [natural_ids(tokenizer, context, r * stride) for r in range(rows)]


def measure(runtime, contexts: list[int], batch_sizes: list[int], methods: list[str], new_tokens: int,
            budget: int, log=print) -> list[dict]:
    """One row per (context, batch size, method), measured and predicted."""
    lm = runtime.lm
    out = []
    for context in contexts:
        prompts = prose_rows(lm.tokenizer, context, max(batch_sizes))
        max_len = context + new_tokens
        started = time.perf_counter()
        caches = [_prefilled(lm, ids, max_len) for ids in prompts]
        log(f"context {context}: {len(prompts)} prompts prefilled in {time.perf_counter() - started:.0f} s")
        for rows in batch_sizes:
            predicted = _predictions(runtime, max_len, rows, budget, methods)
            for method in methods:
                if method not in predicted:
                    log(f"  {rows} x {context} {method}: does not fit")
                    continue
                out.append(_run(runtime, prompts[:rows], caches[:rows], predicted[method], new_tokens, max_len))
                log(f"  {rows} x {context} {method}: {out[-1]['tokens_per_s']} tok/s, "
                    f"{out[-1]['ms_per_token']} ms/token (predicted {out[-1]['predicted_ms_per_token']})")
    _ratios(out)
    return out


def _prefilled(lm, ids: list[int], max_len: int):
    full = FullTier(lm, max_len)
    full.prefill(ids[:-1])
    return full.cache


def _predictions(runtime, max_len: int, rows: int, budget: int, methods: list[str]) -> dict:
    lm = runtime.lm
    fixed = frozenset({"budget"})
    found = predict_batch(lm.config, runtime.profile, max_len, rows, SpecParams(budget=budget),
                          dtype_bytes=lm.dtype.itemsize, fixed=fixed, methods=tuple(methods))
    return {p.method: p for p in found}


def _run(runtime, prompts, caches, prediction: BatchPrediction, new_tokens: int, max_len: int) -> dict:
    spec, fixed = spec_for(prediction, SpecParams(), frozenset())
    run = row_plan(runtime, max_len, len(prompts), spec, fixed)
    engines = []
    for ids, cache in zip(prompts, caches):
        models = row_models(runtime)
        engine = runtime.engine(max_len, run, lm=models.lm, draft=models.draft, graphs="off", kv_cache=cache)
        engine.full.adopt(ids[:-1])
        engines.append((engine, models))
    outcome = generate_batch(runtime, prompts, [new_tokens] * len(prompts), SamplingParams(), frozenset(),
                             len(prompts), run, engines=engines)
    summary = batch_summary(outcome)
    return {"context": len(prompts[0]), "batch_size": len(prompts), "method": prediction.method,
            "budget": prediction.budget, "gamma2": prediction.gamma2, "gamma1": prediction.gamma1,
            "tokens_per_s": summary["throughput_tok_s"], "ms_per_token": summary["latency_ms_per_token"],
            "predicted_ms_per_token": round(prediction.ms_per_token, 2),
            "predicted_tokens_per_s": round(prediction.tokens_per_s, 2),
            "acceptance": summary["acceptance_rates"].get("full"),
            "tokens_per_verify": summary["mean_tokens_per_full_verify"], "rows_per_pass": summary["rows_per_pass"]}


def _ratios(rows: list[dict]) -> None:
    """Each row's throughput against ar's at the same context and batch size (measured, predicted)."""
    ar = {(r["context"], r["batch_size"]): r for r in rows if r["method"] == "ar"}
    for r in rows:
        base = ar.get((r["context"], r["batch_size"]))
        if base is not None:
            r["x_ar"] = round(r["tokens_per_s"] / base["tokens_per_s"], 3)
            r["predicted_x_ar"] = round(r["predicted_tokens_per_s"] / base["predicted_tokens_per_s"], 3)


def crossovers(rows: list[dict]) -> dict[int, int | None]:
    """Per context: the smallest batch size from which some speculative method out-runs ar
    (measured) at that size and every larger one measured; None if none."""
    out = {}
    for context in sorted({r["context"] for r in rows}):
        sizes = sorted({r["batch_size"] for r in rows if r["context"] == context})
        wins = {b: any(r.get("x_ar", 0) > 1 for r in rows if r["context"] == context and r["batch_size"] == b
                       and r["method"] != "ar") for b in sizes}
        start = None
        for b in reversed(sizes):
            if not wins[b]:
                break
            start = b
        out[context] = start
    return out


def gpu_predictions(batch_sizes: list[int], budget: int) -> list[dict]:
    """The cost model's table for GPUs this project targets (random weights need no download)."""
    from triforce.model.architectures import arch_config
    from triforce.plan.profiles import load_profile

    out = []
    for profile_name, arch in GPU_PREDICTIONS:
        profile, model = load_profile(profile_name), arch_config(arch)
        for context in GPU_CONTEXTS:
            for rows in batch_sizes:
                found = {p.method: p for p in predict_batch(model, profile, context, rows, replace(SpecParams(), budget=budget),
                                                            dtype_bytes=2, fixed=frozenset({"budget"}))}
                ar = found.get("ar")
                for method, p in found.items():
                    out.append({"profile": profile_name, "model": arch, "context": context, "batch_size": rows,
                                "method": method, "ms_per_token": round(p.ms_per_token, 2),
                                "tokens_per_s": round(p.tokens_per_s, 1), "gamma2": p.gamma2,
                                "x_ar": round(ar.ms_per_token / p.ms_per_token, 2) if ar else None})
    return out


def plot(rows: list[dict], path: str) -> bool:
    """Throughput against ar by batch size, one panel per context; False without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("note: matplotlib is not installed; no plot", file=sys.stderr)
        return False
    contexts = sorted({r["context"] for r in rows})
    fig, axes = plt.subplots(1, len(contexts), figsize=(5 * len(contexts), 4), squeeze=False)
    for ax, context in zip(axes[0], contexts):
        for method in dict.fromkeys(r["method"] for r in rows):
            mine = sorted((r for r in rows if r["context"] == context and r["method"] == method and "x_ar" in r),
                          key=lambda r: r["batch_size"])
            if mine:
                line, = ax.plot([r["batch_size"] for r in mine], [r["x_ar"] for r in mine], marker="o", label=method)
                ax.plot([r["batch_size"] for r in mine], [r["predicted_x_ar"] for r in mine], linestyle=":",
                        color=line.get_color())
        ax.set_xscale("log", base=2)
        ax.set_title(f"{context} tokens per sequence")
        ax.set_xlabel("batch size")
        ax.set_ylabel("throughput / ar's (dotted: predicted)")
        ax.axhline(1.0, color="grey", linewidth=0.5)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True
