"""Per-step time of each TriForce tier against its bytes floor (issue: GPU fast path).

For one architecture (random weights) at several context lengths, times
  tier 0: one draft-model step over its StreamingLLM cache,
  tier 1: one retrieval-tier verify of gamma1 + 1 tokens over the retrieval cache,
  full:   one full verify of gamma2 + 1 tokens over the whole (resident) KV cache,
  ar:     one token through the same full cache (what --method ar pays per token),
with CUDA graphs on and off for tiers 0 and 1, and flash-attn vs SDPA when flash-attn imports.
The floor of a step is the bytes it must read (weights + KV) over the device memory bandwidth
measured in the same run by a large device-to-device copy. Everything stays on one device (no
offload): this is the kernel-level view. Runs on CPU too (CPU "bandwidth" is a memcpy).

    triforce bench tiers --arch llama2-7b-128k --draft llama-68m --contexts 8192,32768,130048
"""
from __future__ import annotations

import sys

import click
import torch

from triforce.bench.harness import back_to_back_ms, emit, output_option
from triforce.cache.resident import ResidentKVCache
from triforce.cache.sparse import SelectionPolicy
from triforce.config import SpecParams
from triforce.decoding.tiers import DraftModelTier, SparseTier
from triforce.kernels import select_attention
from triforce.model.architectures import build_random_model
from triforce.model.loading import resolve_device
from triforce.plan.measure import memory_gbps


def weight_bytes(lm) -> int:
    """Float parameters plus the block bytes of a quantized model's projections."""
    floats = sum(p.numel() * p.element_size() for p in lm.model.parameters())
    return floats + (lm.quantized["bytes"] if lm.quantized else 0)


def fill_random_kv(cache: ResidentKVCache, length: int) -> None:
    g = torch.Generator(device=cache.k_buf.device).manual_seed(0)
    for buf in (cache.k_buf, cache.v_buf):
        for layer in range(buf.shape[0]):
            buf[layer, :, :, :length].normal_(generator=g)
    cache.length = length


def full_steps(target, full, seq: list[int], context: int, spec: SpecParams, repeats: int, kv_per_token: int) -> dict:
    """The full tier's verify of gamma2 + 1 tokens and an ar step (its price of one), eager, with
    their bytes floors."""
    device, out = target.device, {}
    tokens = torch.tensor([seq[context:context + spec.gamma2 + 1]], device=device)

    def verify():
        full.rollback(context)
        step = full.step(tokens.shape[1])
        target.model(tokens, step.positions, step)

    out["full_ms"] = back_to_back_ms(verify, device, max(1, repeats // 4))
    full.rollback(context)
    out["full_floor_bytes"] = weight_bytes(target) + (context + spec.gamma2 + 1) * kv_per_token

    def ar_step():  # what --method ar pays per token: the full verify's price of one token
        full.rollback(context)
        step = full.step(1)
        target.model(tokens[:, :1], step.positions, step)

    out["ar_ms"] = back_to_back_ms(ar_step, device, max(1, repeats // 4))
    full.rollback(context)
    out["ar_floor_bytes"] = weight_bytes(target) + (context + 1) * kv_per_token
    return out


def measure(target, draft, context: int, spec: SpecParams, graphs: str, repeats: int) -> dict:
    device = target.device
    kv_per_token = 2 * target.config.num_layers * target.config.num_kv_heads * target.config.head_dim \
        * target.dtype.itemsize
    full = ResidentKVCache(target.config, context + spec.gamma2 + 8, dtype=target.dtype, device=device, attn=target.attn)
    fill_random_kv(full, context)
    query = [torch.randn(1, target.config.num_heads, target.config.head_dim, dtype=target.dtype, device=device)
             for _ in range(target.config.num_layers)]
    mode = {"on": "graph" if device.type == "cuda" else "static", "off": "eager"}[graphs]
    retrieval = SparseTier("retrieval", target, SelectionPolicy("retrieval", spec.budget, spec.chunk_size),
                           spec.sparse_append_slots, mode)
    retrieval.rebuild(full, query)
    vocab = min(target.config.vocab_size, draft.config.vocab_size if draft is not None else 1 << 30)
    seq = [3 + i % (vocab - 3) for i in range(context + spec.gamma2 + 1)]  # ids both vocabularies have

    def tier1():
        retrieval.truncate(context)
        retrieval.logits(seq)

    out = {"context": context, "runner": mode}
    if graphs == "off":  # a rebuild after rebuild_stride new tokens: chunk means extended, or all recomputed
        def rebuild_incremental():
            full.rollback(context - spec.rebuild_stride)  # the last stride's chunks count as new again
            full.length = context
            retrieval.rebuild(full, query)

        def rebuild_from_scratch():
            full._means.clear()
            retrieval.rebuild(full, query)

        out["rebuild_ms"] = round(back_to_back_ms(rebuild_incremental, device, max(1, repeats // 4)), 3)
        out["rebuild_recomputing_means_ms"] = round(back_to_back_ms(rebuild_from_scratch, device, max(1, repeats // 4)), 3)
    out["tier1_ms"] = back_to_back_ms(tier1, device, repeats)
    out["tier1_floor_bytes"] = weight_bytes(target) + (retrieval.cache.end + spec.gamma1 + 1) * kv_per_token
    if draft is not None:
        tier0 = DraftModelTier(draft, target, spec.sink_tokens, spec.draft_window_tokens, spec.draft_slack, mode)
        tier0.start(seq[:context + 1])
        covered = tier0.cache.length

        def step0():
            tier0.truncate(covered)
            tier0.logits(seq[:covered + 1])

        out["tier0_ms"] = back_to_back_ms(step0, device, repeats)
        d_kv = 2 * draft.config.num_layers * draft.config.num_kv_heads * draft.config.head_dim \
            * draft.dtype.itemsize
        out["tier0_floor_bytes"] = weight_bytes(draft) + tier0.cache.end * d_kv
    if graphs == "off":  # the full verify never runs under graphs
        out.update(full_steps(target, full, seq, context, spec, repeats, kv_per_token))
    return out


@click.command()
@click.option("--arch", default="llama2-7b-128k", show_default=True)
@click.option("--draft", default="llama-68m", show_default=True, help="Architecture of the tier-0 draft model.")
@click.option("--contexts", default="8192,32768,130048", show_default=True)
@click.option("--dtype", default="bfloat16", show_default=True)
@click.option("--device", default="cuda" if torch.cuda.is_available() else "cpu", show_default=True)
@click.option("--budget", type=int, default=4096, show_default=True)
@click.option("--gamma1", type=int, default=2, show_default=True)
@click.option("--gamma2", type=int, default=6, show_default=True)
@click.option("--repeats", type=int, default=20, show_default=True)
@click.option("--attn", "attns", default="sdpa,flash", show_default=True, help="Backends to compare (flash when it imports).")
@click.option("--quantize", type=click.Choice(["none", "q8_0", "q4_0", "q4_1", "q4_k"]), default="none",
              show_default=True, help="The target's projections as random blocks (the draft stays float).")
@output_option
def main(arch, draft, contexts, dtype, device, budget, gamma1, gamma2, repeats, attns, quantize, fmt):
    """Each tier's step time against its bytes floor, CUDA graphs on and off."""
    device = resolve_device(device)
    target = build_random_model(arch, dtype, str(device), quantize=None if quantize == "none" else quantize)
    drafter = build_random_model(draft, dtype, str(device), seed=1) if draft else None
    spec = SpecParams(method="triforce", budget=budget, gamma1=gamma1, gamma2=gamma2)
    gbps = memory_gbps(device)
    rows = []
    for attn in attns.split(","):
        try:
            backend, line = select_attention(attn, device)
        except ValueError as e:
            print(f"skipping --attn {attn}: {e}", file=sys.stderr)
            continue
        target.attn = backend
        if drafter is not None:
            drafter.attn = backend
        for context in (int(c) for c in contexts.split(",")):
            for graphs in ("off", "on"):
                print(f"{attn} context {context} graphs {graphs} ...", file=sys.stderr)
                try:
                    row = {"attn": backend.name, **measure(target, drafter, context, spec, graphs, repeats)}
                except torch.OutOfMemoryError:
                    print(f"context {context} does not fit this device's memory: skipped", file=sys.stderr)
                    torch.cuda.empty_cache()
                    continue
                for tier in ("tier0", "tier1", "full", "ar"):
                    if f"{tier}_ms" in row:
                        floor_ms = row[f"{tier}_floor_bytes"] / (gbps * 1e9) * 1e3
                        row[f"{tier}_floor_ms"] = round(floor_ms, 4)
                        row[f"{tier}_x_floor"] = round(row[f"{tier}_ms"] / floor_ms, 2)
                        row[f"{tier}_ms"] = round(row[f"{tier}_ms"], 4)
                rows.append(row)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    out = {"arch": arch, "draft": draft, "device": str(device), "dtype": dtype, "quantize": quantize,
           "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "memory_gbps_measured": round(gbps, 1), "budget": budget, "gamma1": gamma1, "gamma2": gamma2}
    emit(fmt, out, rows, lambda: table(out, rows))


def table(out: dict, rows: list[dict]) -> None:
    print(f"{out['arch']} + {out['draft']}, {out['dtype']} (weights {out['quantize']}) on {out['device_name']}; "
          f"device memory bandwidth measured now: {out['memory_gbps_measured']} GB/s")
    print(f"{'attn':6s} {'context':>8s} {'runner':>6s} {'tier0 ms':>9s} {'x floor':>8s} {'tier1 ms':>9s} "
          f"{'x floor':>8s} {'full ms':>9s} {'x floor':>8s} {'ar ms':>9s} {'x floor':>8s}")
    for r in rows:
        if "rebuild_ms" in r:
            print(f"{'':6s} {r['context']:8d} retrieval rebuild ({r['attn']}, {out['budget']} tokens): "
                  f"{r['rebuild_ms']:.3f} ms with kept chunk means, {r['rebuild_recomputing_means_ms']:.3f} ms "
                  "recomputing them")
        print(f"{r['attn']:6s} {r['context']:8d} {r['runner']:>6s} {r.get('tier0_ms', float('nan')):9.3f} "
              f"{r.get('tier0_x_floor', float('nan')):8.2f} {r['tier1_ms']:9.3f} {r['tier1_x_floor']:8.2f} "
              f"{r.get('full_ms', float('nan')):9.3f} {r.get('full_x_floor', float('nan')):8.2f} "
              f"{r.get('ar_ms', float('nan')):9.3f} {r.get('ar_x_floor', float('nan')):8.2f}")


if __name__ == "__main__":
    main()
