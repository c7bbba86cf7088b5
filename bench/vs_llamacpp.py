"""triforce's AR decoding and prefill against llama.cpp's llama-bench on the same weights, and
against the memory bandwidth of this machine, measured side by side in one run.

    # llama-bench: build llama.cpp with cmake (`cmake --build build --target llama-bench`); the
    # GGUFs: llama.cpp's convert_hf_to_gguf.py on the default model's folder, --outtype f32 and bf16
    triforce bench llamacpp --llama-bench ~/.cache/llamacpp/bin/llama-bench \\
        --gguf float32=model-f32.gguf --gguf bfloat16=model-bf16.gguf --depths 2048,6144

With `--long N` a last row decodes at depth N (32000: the KV then outweighs the weights ~3x) in
the dtype `--dtype auto` picks on this CPU (bfloat16 with AVX512-BF16, float32 elsewhere; its
`--gguf` must be given): llama-bench -d N, and ours with the model stretched to N tokens (YaRN), once as --method ar
and once as --method triforce --draft lookup after the same prefill, in turns `--repeats` times
(bench/vs_transformers.py's method_speed), `--long-new-tokens` tokens each (128: the first 64 tokens after
the prose prompt drafted worse, acceptance 0.32/0.72 against 0.52/0.84 over 128). Both sides prefill N tokens first: minutes each.

Each row alternates the two programs (llama-bench, then ours) `--repeats` times and keeps each
side's best, so a noisy neighbour costs both. Decode: `--new-tokens` greedy tokens after a
prose context of `depth` tokens (llama-bench -d depth -n N). Prefill: a `--prefill` prompt
(llama-bench -p N). Bytes per token = weights + KV read at that depth; bandwidth = a 512 MB
sum over all threads, taken in the same run. llama.cpp keeps its KV in float16 (its default).
"reference kernels" is our decode through one nn.Linear per matrix and PyTorch's SDPA (the plain
paths, before the CPU kernels). `--beside quiet,busy,busy-nice19` runs it all again beside busy
neighbours (triforce.bench.busy_neighbours), each condition in a fresh process; `--rounds 3`
cycles through them three times, each round starting one condition later, and keeps each side's
best per condition (a VM that drifts 20% in minutes made one pass of blocks read as a condition's
cost: nice 19 read 0.85x where 12 shuffled rounds in one process read 0.976x, issue 76).

    triforce bench llamacpp --llama-bench ~/.cache/llamacpp/bin/llama-bench \\
        --gguf gguf=SmolLM2-135M-Instruct.Q4_1.gguf --depths 2048 --prefill 0 --repeats 2 \\
        --beside quiet,busy,busy-nice19 --rounds 3

A `gguf=FILE` row runs ours on FILE's own blocks, so several files are compared in one run, each
row naming its file: `--gguf gguf=model-Q4_0.gguf --gguf gguf=model-Q8_0.gguf`."""
from __future__ import annotations

import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import click
import torch

from triforce.bench.harness import emit, output_option
from triforce.bench.vs_transformers import time_transformers, time_triforce

QUANTIZED = ("gguf", "q8_0", "q4_0", "q4_1", "q4_k")


def memory_bandwidth() -> float:
    """Bytes/s of a 512 MB float32 sum over torch's threads (best of 5)."""
    data = torch.ones(128 * 1024 * 1024)
    best = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - started)
    return data.nbytes / best


def llama_bench(binary: str, gguf: str, threads: int, *, depth: int = 0, gen: int = 0, prompt: int = 0) -> float:
    """tokens/s that llama-bench reports for one test (one repetition)."""
    cmd = [binary, "-m", gguf, "-t", str(threads), "-p", str(prompt), "-n", str(gen), "-d", str(depth),
           "-r", "1", "-o", "json"]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return float(json.loads(done.stdout)[0]["avg_ts"])


def ours_prefill(lm, ids: list[int]) -> float:
    from triforce.config import SpecParams
    from triforce.decoding.engine import Engine

    engine = Engine(lm, SpecParams(method="ar"), len(ids) + 1)
    started = time.perf_counter()
    engine.set_sequence(ids + [0])  # the whole prompt goes into the cache
    return len(ids) / (time.perf_counter() - started)


def reference_decode(lm, ids: list[int], new_tokens: int) -> float:
    """Decode tok/s through the plain paths (one nn.Linear per matrix, PyTorch SDPA), for the gain."""
    from triforce.kernels import SDPA, SdpaReference

    lm.model.use_kernels("reference")
    lm.attn = SdpaReference()
    try:
        return time_triforce(lm, ids, new_tokens)["decode_tokens_per_s"]
    finally:
        lm.model.use_kernels("fused")
        lm.attn = SDPA


def bytes_per_token(lm, depth: int) -> int:
    """Weights (tied embeddings once; blocks as held) plus the KV of `depth` tokens in the model's dtype."""
    weights = sum(p.nbytes for p in {p.data_ptr(): p for p in lm.model.parameters()}.values())
    weights += lm.quantized["bytes"] if lm.quantized else 0
    cfg = lm.config
    kv = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * depth * lm.dtype.itemsize
    return weights + kv


def plot(rows: list[dict], path: str, machine: str) -> None:
    """Grouped bars: tokens/s of each side per dtype and test (decode and prefill on own axes)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sides = [("triforce_tok_s", "triforce (ar)"), ("speculation_tok_s", "triforce (triforce, lookup)"),
             ("llamacpp_tok_s", "llama.cpp"), ("transformers_tok_s", "transformers")]
    kinds = [k for k in ("decode", "prefill") if any(r["test"] == k for r in rows)]
    fig, axes = plt.subplots(1, len(kinds), figsize=(12, 4.5), squeeze=False,
                             gridspec_kw={"width_ratios": [3, 1][:len(kinds)]})
    for ax, kind in zip(axes[0], kinds):
        chosen = [r for r in rows if r["test"] == kind]
        shown = [(key, label) for key, label in sides if any(key in r for r in chosen)]
        width = 0.8 / max(len(shown), 1)
        for j, (key, label) in enumerate(shown):
            ax.bar([i + (j - (len(shown) - 1) / 2) * width for i in range(len(chosen))],
                   [r.get(key, 0) for r in chosen], width, label=label,
                   color=f"C{[k for k, _ in sides].index(key)}")  # a side keeps its colour in both panels
        ax.set_xticks(list(range(len(chosen))), [f"{r['dtype']}\n{r['tokens']}" for r in chosen])
        ax.set_ylabel("tokens/s")
        ax.set_title(f"{kind} ({'context depth' if kind == 'decode' else 'prompt'} tokens)")
        ax.legend(fontsize=8)
    fig.suptitle(machine, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def long_row(model: str, dtype: str, binary: str, gguf: str, threads: int, depth: int, new_tokens: int, budget: int,
             rounds: int) -> dict:
    """Decoding at `depth` in `dtype`: llama-bench, and our ar and triforce (lookup drafts) on the
    model stretched to that depth (YaRN) after one prefill, in turns."""
    from triforce.bench.vs_transformers import method_speed
    from triforce.model.context_stretch import stretch_request, trained_context
    from triforce.model.hf_config import read_hf_config
    from triforce.model.loading import load_model, resolve_model_dir

    stretch_to = 1 << (depth + new_tokens).bit_length()  # a power of two past the run
    if stretch_to <= trained_context(read_hf_config(resolve_model_dir(model))):
        stretch_to = 0  # within the trained context: nothing to stretch
    lm = load_model(model, dtype=dtype, device="cpu",
                    rope_scaling=stretch_request(stretch_to, "yarn") if stretch_to else None)
    ar, spec = method_speed(lm, depth, new_tokens, budget, ("ar", "triforce"), ("natural",), rounds)
    theirs = llama_bench(binary, gguf, threads, depth=depth, gen=new_tokens)
    return {"dtype": dtype, "test": "decode", "tokens": depth, "triforce_tok_s": ar["decode_tok_s"],
            "llamacpp_tok_s": round(theirs, 2), "ratio": round(ar["decode_tok_s"] / theirs, 3),
            "triforce_gb_s": round(bytes_per_token(lm, depth) * ar["decode_tok_s"] / 1e9, 1),
            "speculation_tok_s": spec["decode_tok_s"], "speculation_vs_ar": spec["speedup_vs_ar"],
            "stretched_to": stretch_to, "budget": budget, "acceptance_rates": spec["acceptance_rates"],
            "speculation_tier_time_s": spec["tier_time_s"], "speculation_full_verifies": spec["full_verifies"]}


def side_by_side(lm, hf, binary, gguf, threads: int, kind: str, n: int, new_tokens: int, repeats: int,
                 quantize: str | None, dtype: str) -> dict:
    """One row: llama-bench and ours (and the reference path, transformers) on `kind` (decode after
    n tokens of natural text, or a prefill of n), best of `repeats`, interleaved."""
    from triforce.app.texts import natural_ids

    ids = natural_ids(lm.tokenizer, n)
    theirs, ours, reference, hf_rate = 0.0, 0.0, 0.0, 0.0
    for _ in range(repeats):
        if kind == "decode":
            theirs = max(theirs, llama_bench(binary, gguf, threads, depth=n, gen=new_tokens))
            ours = max(ours, time_triforce(lm, ids, new_tokens + 1)["decode_tokens_per_s"])
            if quantize is None:  # the reference path de-quantizes every matrix per pass
                reference = max(reference, reference_decode(lm, ids, new_tokens + 1))
            if hf is not None:
                hf_rate = max(hf_rate, time_transformers(hf, ids, new_tokens)["decode_tokens_per_s"])
        else:
            theirs = max(theirs, llama_bench(binary, gguf, threads, prompt=n))
            ours = max(ours, ours_prefill(lm, ids))
    row = {"dtype": dtype, "file": Path(gguf).name, "activations": str(lm.dtype).removeprefix("torch."),
           "ours_weights": lm.quantized["weights"] if lm.quantized else dtype, "test": kind, "tokens": n,
           "triforce_tok_s": round(ours, 2),
           "llamacpp_tok_s": round(theirs, 2), "ratio": round(ours / theirs, 3)}
    if kind == "decode":
        row["reference_tok_s"] = round(reference, 2)
        if hf is not None:
            row["transformers_tok_s"] = round(hf_rate, 2)
        row["triforce_gb_s"] = round(bytes_per_token(lm, n) * ours / 1e9, 1)
    return row


@click.command()
@click.option("--llama-bench", "binary", required=True, help="Path of a llama-bench binary.")
@click.option("--gguf", "ggufs", multiple=True, required=True,
              help="DTYPE=PATH: the GGUF of --model in that dtype (float32, bfloat16), or WEIGHTS=PATH with WEIGHTS "
                   "a --quantize choice: gguf (ours reads PATH's own blocks: the same file on both sides; repeat "
                   "it for several files), q8_0, q4_0, q4_1, q4_k (ours: --model quantized at load; llama.cpp's "
                   "from llama-quantize).")
@click.option("--model", default="default", show_default=True,
              help="Our side of the DTYPE and quantized-at-load rows: the same weights as their GGUFs.")
@click.option("--depths", default="2048,6144", show_default=True, help="Context depths for decoding ('': none).")
@click.option("--new-tokens", type=click.IntRange(2, 4096), default=64, show_default=True)
@click.option("--prefill", type=click.IntRange(0, 65536), default=2048, show_default=True,
              help="Prompt length of the prefill row (0: no prefill row).")
@click.option("--repeats", type=click.IntRange(1, 20), default=2, show_default=True)
@click.option("--long", "long_depth", type=click.IntRange(0, 1 << 20), default=0, show_default=True,
              help="Also a decode row at this depth (e.g. 32000) in the dtype auto picks here, with --method "
                   "triforce too (0: none).")
@click.option("--long-budget", type=click.IntRange(64, 1 << 20), default=2048, show_default=True,
              help="Retrieval cache budget of the --long row's triforce run.")
@click.option("--long-new-tokens", type=click.IntRange(2, 4096), default=128, show_default=True,
              help="Tokens decoded in the --long row (the goal's 128; short runs see little prompt lookup).")
@click.option("--transformers", "with_hf", is_flag=True, help="Also time transformers' generate (decode rows).")
@click.option("--beside", default="quiet", show_default=True,
              help="Also measure beside busy neighbours, each condition in a fresh process (ours picks its "
                   "threads at start): quiet, busy (one process spinning a core), N-busy, busy-niceK (at nice K), "
                   "e.g. quiet,busy,busy-nice19,2-busy; each row then carries `beside` and its speeds against "
                   "the quiet row's.")
@click.option("--rounds", type=click.IntRange(1, 20), default=1, show_default=True,
              help="With --beside: cycle through the conditions this many times, each round starting one "
                   "later, keeping each side's best per condition (a drifting machine then weighs on all).")
@click.option("--plot", "plot_path", default=None, help="Also draw the table as a PNG here.")
@output_option
def main(binary, ggufs, model, depths, new_tokens, prefill, repeats, long_depth, long_budget, long_new_tokens, with_hf,
         beside, rounds, plot_path, fmt):
    """Against llama.cpp's llama-bench on the same GGUF files and depths (see the module's docstring)."""
    from triforce.bench.busy_neighbours import parse_beside
    from triforce.model.loading import load_model, resolve_dtype

    conditions = parse_beside(beside)
    if rounds > 1 and len(conditions) < 2:
        raise click.UsageError("--rounds cycles through --beside's conditions: give two or more")
    if [c.name for c in conditions] != ["quiet"]:
        flags = ["--llama-bench", binary, *[arg for g in ggufs for arg in ("--gguf", g)], "--model", model,
                 "--depths", depths, "--new-tokens", new_tokens, "--prefill", prefill, "--repeats", repeats,
                 "--long", long_depth, "--long-budget", long_budget, "--long-new-tokens", long_new_tokens,
                 *(["--transformers"] if with_hf else [])]
        info, rows = beside_rows(conditions, [str(f) for f in flags], rounds)
        if plot_path:
            plot(rows, plot_path, info["machine"])
        emit(fmt, info, rows, lambda: table(info, rows))
        return
    threads = torch.get_num_threads()
    auto_dtype = str(resolve_dtype("auto", torch.device("cpu"))).removeprefix("torch.")
    if long_depth and auto_dtype not in [item.partition("=")[0] for item in ggufs]:
        raise click.UsageError(f"--long runs in {auto_dtype} on this CPU: give --gguf {auto_dtype}=FILE")
    bandwidth = memory_bandwidth()
    rows = []
    for item in ggufs:
        dtype, _, gguf = item.partition("=")
        quantize = dtype if dtype in QUANTIZED else None
        # blocks: activations and KV in the dtype --dtype auto picks here, as the default run holds them
        lm = load_model(gguf if dtype == "gguf" else model, dtype=auto_dtype if quantize else dtype, device="cpu",
                        quantize=quantize)
        hf = None
        if with_hf:
            from triforce.model.loading import transformers_model
            hf = transformers_model(lm.path, lm.dtype)
        tests = [("decode", int(d)) for d in depths.split(",") if d.strip()] + ([("prefill", prefill)] if prefill else [])
        for kind, n in tests:
            rows.append(side_by_side(lm, hf, binary, gguf, threads, kind, n, new_tokens, repeats, quantize, dtype))
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
        del lm, hf
        if long_depth and dtype == auto_dtype:
            rows.append(long_row(model, dtype, binary, gguf, threads, long_depth, long_new_tokens, long_budget,
                                 repeats))
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    info = {"machine": f"{platform.machine()} {platform.processor() or ''} {threads} threads, torch {torch.__version__}",
            "memory_bandwidth_gb_s": round(bandwidth / 1e9, 1), "new_tokens": new_tokens}
    if plot_path:
        plot(rows, plot_path, info["machine"])
    emit(fmt, info, rows, lambda: table(info, rows))


def beside_rows(conditions, flags: list[str], rounds: int = 1) -> tuple[dict, list[dict]]:
    """Every row under each condition, from fresh runs of this benchmark beside its neighbours,
    `rounds` times (round r starts at condition r), each side's best kept; a row beside neighbours
    also has both sides' speeds against the quiet row's (where measured)."""
    from triforce.bench.busy_neighbours import running

    info, best = {}, {}
    for turn in range(rounds):
        start = turn % len(conditions)
        for condition in conditions[start:] + conditions[:start]:
            with running(condition):
                done = subprocess.run([sys.executable, "-m", "triforce.bench.vs_llamacpp", *flags, "--json"],
                                      stdout=subprocess.PIPE, text=True, check=True)
            report = json.loads(done.stdout)
            info = info or {k: v for k, v in report.items() if k not in ("rows", "provenance")}
            for row in report["rows"]:
                key = (condition.name, *_row_key(row))
                best[key] = _best_of(best.get(key), {"beside": condition.name, **row})
    rows = list(best.values())
    quiet = {_row_key(r): r for r in rows if r["beside"] == "quiet"}
    for row in rows:
        base = quiet.get(_row_key(row))
        if base is not None and row is not base:
            row["triforce_vs_quiet"] = round(row["triforce_tok_s"] / base["triforce_tok_s"], 3)
            row["llamacpp_vs_quiet"] = round(row["llamacpp_tok_s"] / base["llamacpp_tok_s"], 3)
    return info, rows


def _row_key(row: dict) -> tuple:
    """What one row measures: its weights (and file), test and depth."""
    return row["dtype"], row.get("file"), row["test"], row["tokens"]


def _best_of(kept: dict | None, row: dict) -> dict:
    """One row from two rounds of it: each side's faster speed (ours: the whole of our part of the
    row, its other figures measured with it), the ratio between them again, the rounds counted."""
    if kept is None:
        return {**row, "rounds": 1}
    ours = row if row["triforce_tok_s"] > kept["triforce_tok_s"] else kept
    merged = {**ours, "llamacpp_tok_s": max(row["llamacpp_tok_s"], kept["llamacpp_tok_s"]),
              "rounds": kept["rounds"] + 1}
    merged["ratio"] = round(merged["triforce_tok_s"] / merged["llamacpp_tok_s"], 3)
    return merged


def table(info: dict, rows: list[dict]) -> None:
    print(f"{info['machine']}; memory bandwidth (512 MB sum): {info['memory_bandwidth_gb_s']} GB/s")
    beside = any("beside" in r for r in rows)
    print(("| beside " if beside else "") + "| dtype | test | tokens | triforce tok/s | llama.cpp tok/s | ratio | "
          "triforce GB/s | reference kernels tok/s | transformers tok/s | --method triforce tok/s (vs ar) |")
    print(("|---" if beside else "") + "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        spec = f"{r['speculation_tok_s']} ({r['speculation_vs_ar']}x)" if "speculation_tok_s" in r else ""
        ours, theirs = r["triforce_tok_s"], r["llamacpp_tok_s"]
        if "triforce_vs_quiet" in r:  # beside neighbours: each side against its own quiet speed
            ours, theirs = f"{ours} ({r['triforce_vs_quiet']}x)", f"{theirs} ({r['llamacpp_vs_quiet']}x)"
        first = f"| {r['beside']} " if beside else ""
        weights = f"{r['dtype']} ({r['file']})" if r.get("file") and r["dtype"] == "gguf" else r["dtype"]
        print(first + f"| {weights} | {r['test']} | {r['tokens']} | {ours} | {theirs} | "
              f"{r['ratio']} | {r.get('triforce_gb_s', '')} | {r.get('reference_tok_s', '')} | "
              f"{r.get('transformers_tok_s', '')} | {spec} |")


if __name__ == "__main__":
    main()
