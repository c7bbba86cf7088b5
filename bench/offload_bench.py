"""Offloaded decoding side by side: ar-offload (the planner's placement, autoregressive, the host
KV streamed every token), zero-inference (all KV on the host, attention on the CPU) and triforce.

Random-weight architectures time the real kernels; their KV is filled with random values instead
of a real prefill (decode time does not depend on the values), and the triforce row replays the
accept/reject sequence recorded from a real model (`generate --record-acceptance`)."""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from triforce.app.plan_and_cache import build_kv_cache
from triforce.bench.harness import sync
from triforce.bench.offload_peers import HostAttentionKVCache
from triforce.cache.resident import ResidentKVCache
from triforce.config import SamplingParams, SpecParams
from triforce.decoding.acceptance_trace import ReplayVerifier
from triforce.errors import UserError
from triforce.cache.offloaded import OffloadedKVCache

# ar-offload: the paper's baseline (every host block over PCIe); ar-hybrid: the stronger one (the
# CPU attends its share in place, offload.hybrid); triforce splits as the plan says, and its
# variants turn one of its parts on (drafting the next cycle during each verify) or off
METHODS = ("ar-offload", "ar-hybrid", "zero-inference", "triforce", "triforce-ahead", "triforce-no-hybrid",
           "triforce-no-residency", "transformers-offloaded")


@dataclass(frozen=True)
class Variant:
    speculative: bool
    hybrid: bool = True      # the CPU attends its share of the host KV in place
    residency: bool = True   # the prefill's scratch holds whole host blocks once decoding starts
    ahead: bool = False      # the next cycle drafted during each verify


VARIANTS = {"ar-offload": Variant(False, hybrid=False), "ar-hybrid": Variant(False), "zero-inference": Variant(False),
            "triforce": Variant(True), "triforce-ahead": Variant(True, ahead=True),
            "triforce-no-hybrid": Variant(True, hybrid=False), "triforce-no-residency": Variant(True, residency=False)}
SPECULATIVE = tuple(m for m, v in VARIANTS.items() if v.speculative)
SPECULATIVE_TOKENS = 64  # speculative rows time at least this many by default: several full verifies and a rebuild
ALL_GIVEN = frozenset({"budget", "chunk_size", "gamma1", "gamma2"})  # the bench's speculation is not re-chosen


def measure_h2d_gbps(device: torch.device, num_bytes: int = 256 << 20, repeats: int = 3) -> float:
    """Best of `repeats` copies of a pinned host buffer to the device (a memcpy on a CPU)."""
    pin = device.type == "cuda"
    src = torch.empty(num_bytes, dtype=torch.uint8, device="cpu", pin_memory=pin)
    dst = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    best = float("inf")
    for _ in range(repeats):
        sync(device)
        started = time.perf_counter()
        dst.copy_(src, non_blocking=pin)
        sync(device)
        best = min(best, time.perf_counter() - started)
    return num_bytes / best / 1e9


def fill_random_kv(cache, length: int, seed: int = 0, arena=None) -> None:
    """Make `cache` hold `length` tokens of random KV without a prefill (timing only). Host
    blocks are copies of one random block, which fills tens of GiB at memcpy speed; a store in
    `arena`'s bytes is filled there once for every method that borrows it."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    if isinstance(cache, ResidentKVCache):
        cache.k_buf[:, :, :, :length].normal_()
        cache.v_buf[:, :, :, :length].normal_()
        cache.length = length
        return
    if not isinstance(cache, (OffloadedKVCache, HostAttentionKVCache)):
        raise TypeError(f"cannot fill {type(cache).__name__}")
    store = cache.store
    if isinstance(cache, OffloadedKVCache):
        cache.k_res.normal_()
        cache.v_res.normal_()
        blocks = store.num_blocks
    else:
        blocks = -(-length // store.block_tokens)
    if arena is not None:
        arena.fill_random(store.nbytes, store.data.dtype, seed)
    else:
        template = torch.randn(store.block(0, 0).shape, generator=g, device="cpu").to(store.data.dtype)
        for layer in range(store.data.shape[0]):
            for block in range(blocks):
                store.block(layer, block).copy_(template)
    cache.length = length


@dataclass
class Setup:
    runtime: object            # triforce.app.runtime.Runtime: the target, the draft, the engines
    profile: object
    context: int
    new_tokens: int
    spec: SpecParams
    trace: dict | None
    overlap: bool = True
    prompt_ids: list[int] | None = None  # a real prompt to prefill; None: random KV (random weights)
    hybrid: bool = True
    repeats: int = 2           # timed windows per method after the warm-up (their spread is reported)
    speculative_tokens: int = SPECULATIVE_TOKENS  # speculative rows time at least this many per window
    arena: object = None       # triforce.pinned.HostArena the methods' host stores borrow in turn

    @property
    def lm(self):
        return self.runtime.lm


def sized_gamma2(runtime, context: int, spec: SpecParams, trace: dict) -> int:
    """gamma2 the cost model picks for the trace's acceptance on this run's plan (plan.cost_model
    best_gammas), at most the trace's own: a replayed check accepts no more than was recorded."""
    from triforce.decoding.acceptance_trace import trace_acceptance
    from triforce.plan.cost_model import best_gammas
    from triforce.plan.planner import hardware

    try:
        run = runtime.plan(context + SPECULATIVE_TOKENS, spec, ALL_GIVEN)
    except UserError:  # the triforce row reports that it does not fit; the other rows still run
        return spec.gamma2
    if run.plan.step_costs is None:
        return spec.gamma2
    hw = hardware(runtime.profile, runtime.lm.dtype.itemsize)
    cap = int(trace.get("gamma2", spec.gamma2))
    return best_gammas(run.plan.step_costs, hw, trace_acceptance(trace), True, (spec.gamma1,), range(1, cap + 1))[1]


def method_setting(method: str, s: Setup) -> tuple[SpecParams, int, int, int]:
    """(spec, tokens per timed window, tokens of the window whose syncs are counted, cache length)."""
    speculative = VARIANTS[method].speculative
    spec = s.spec if speculative else SpecParams(method="ar")
    new_tokens = max(s.new_tokens, s.speculative_tokens) if speculative else s.new_tokens
    counted = spec.gamma2 + 1 if speculative else 1
    return spec, new_tokens, counted, s.context + 2 + new_tokens * s.repeats + counted + 8


def host_store_bytes(method: str, s: Setup) -> int:
    """Bytes of the host KV store `method` builds (0: none, or its plan does not fit)."""
    from triforce.bench.offload_peers import BLOCK_TOKENS
    from triforce.pinned import HostKVStore

    if method not in VARIANTS:
        return 0
    spec, _, _, max_len = method_setting(method, s)
    c, dtype = s.lm.config, s.lm.dtype
    if method == "zero-inference":
        return HostKVStore.bytes_for(c.num_layers, c.num_kv_heads, c.head_dim, max_len, BLOCK_TOKENS, dtype)
    try:
        plan = s.runtime.plan(max_len, spec, ALL_GIVEN).plan
    except UserError:
        return 0
    if plan.resident_tokens >= max_len:
        return 0
    return HostKVStore.bytes_for(c.num_layers, c.num_kv_heads, c.head_dim, max_len - plan.resident_tokens,
                                 plan.block_tokens, dtype)


def _engine_over_context(method: str, s: Setup, run, max_len: int):
    """(cache, engine) of `method` holding the context: a real prefill of the prompt, else random KV."""
    device, variant = s.lm.device, VARIANTS[method]
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    if method == "zero-inference":
        cache = HostAttentionKVCache(s.lm.config, max_len, dtype=s.lm.dtype, device=device,
                                     host_budget_bytes=s.profile.host_bytes, host_arena=s.arena)
    else:
        cache = build_kv_cache(s.lm, max_len, run.plan, overlap=s.overlap, hybrid=variant.hybrid and s.hybrid,
                               residency=variant.residency, host_arena=s.arena)
    replay = ReplayVerifier(s.trace) if variant.speculative and s.trace is not None else None
    engine = s.runtime.engine(max_len, run, kv_cache=cache, replay=replay, draft_ahead=variant.ahead)
    if s.prompt_ids is not None:
        from triforce.app.progress import prefill_bar

        ids = s.prompt_ids
        bar = prefill_bar(len(ids) - 1, desc=f"prefill ({method})")
        try:
            engine.set_sequence(ids, bar.update)  # a real prefill: real models must see their real KV
        finally:
            bar.close()
    else:
        vocab = min(s.lm.config.vocab_size, 32000)
        ids = torch.randint(3, vocab, (s.context,), generator=torch.Generator(device="cpu").manual_seed(1), device="cpu").tolist()
        fill_random_kv(cache, s.context - 1, arena=s.arena)
        engine.full.tokens = ids[:-1]
        engine.set_sequence(ids)
    return cache, engine


def run_method(method: str, s: Setup) -> dict:
    """Decode `new_tokens` after a `context`-token cache; returns the row of the table."""
    device = s.lm.device
    if method == "transformers-offloaded":  # the peer: its own model and cache (bench/offload_peers.py)
        from triforce.bench.offload_peers import time_hf_offloaded
        arch = getattr(s.runtime.config, "arch", None)
        if arch is None:
            return {"method": method, "error": "timed with --arch only"}
        try:
            return time_hf_offloaded(arch, s.context, s.new_tokens, s.lm.dtype, device)
        except (RuntimeError, ValueError, TypeError, AttributeError) as e:  # a peer's failure is a row, not the end
            return {"method": method, "error": f"{type(e).__name__}: {str(e)[:300]}"}
    speculative = VARIANTS[method].speculative
    spec, new_tokens, counted, max_len = method_setting(method, s)
    try:
        run = s.runtime.plan(max_len, spec, ALL_GIVEN)
    except UserError as e:
        return {"method": method, "error": str(e)}
    plan, (cache, engine) = run.plan, _engine_over_context(method, s, run, max_len)
    engine.generate(2, SamplingParams(), frozenset())  # warm-up: kernels, allocator, first copies
    before, cpu_before = _transfer_bytes(cache), getattr(cache, "cpu_bytes", 0)
    windows = []
    for _ in range(s.repeats):  # the same cache, later positions: a steady state, rebuilds inside
        sync(device)
        result = engine.generate(new_tokens, SamplingParams(), frozenset())
        sync(device)
        windows.append(result)
    h2d, d2h = (a - b for a, b in zip(_transfer_bytes(cache), before))
    tokens = sum(len(r.tokens) for r in windows)
    seconds = sum(r.time_s for r in windows)
    per_window = [1000 * r.time_s / len(r.tokens) for r in windows]
    result = windows[-1]
    row = {
        "method": method, "tokens": tokens, "ms_per_token": round(1000 * seconds / tokens, 2),
        "ms_per_token_windows": [round(ms, 2) for ms in per_window],
        "spread": round((max(per_window) - min(per_window)) / min(per_window), 3),
        "pcie_bytes_per_token": int((h2d + d2h) / tokens),
        "cpu_attended_bytes_per_token": int((getattr(cache, "cpu_bytes", 0) - cpu_before) / tokens),
        "achieved_h2d_gbps": round(h2d / seconds / 1e9, 2),
        "plan_gpu_bytes": plan.gpu_bytes_total, "budget_bytes": plan.gpu_budget_bytes,
        "resident_tokens": plan.resident_tokens if method != "zero-inference" else 0,
        "decode_resident_tokens": cache.device_tokens if isinstance(cache, OffloadedKVCache) else 0,
        "host_kv_bytes": plan.host_kv_bytes if method != "zero-inference" else cache.host_nbytes,
        "peak_gpu_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
        "host_store_shared": s.arena is not None,
    }
    if method in ("ar-hybrid", *SPECULATIVE):
        row["hybrid_cpu_share"] = round(cache.cpu_share(spec.gamma2 + 1 if speculative else 1), 3) \
            if isinstance(cache, OffloadedKVCache) else 0.0
    if speculative:
        row.update(mean_tokens_per_full_verify=result.stats["mean_tokens_per_full_verify"],
                   acceptance_rates=result.stats["acceptance_rates"],
                   replayed=s.trace is not None, tiers=engine.describe(),
                   drafted_ahead=_ahead_share(windows) if engine.ahead is not None else None,
                   window_parts=[_window_parts(r) for r in windows])
    row.update(counted_window(engine, counted))
    sync(device)  # the counted window's prefetches land before the next method reuses their memory
    del engine, cache
    _give_back(device)
    return row


def _give_back(device: torch.device) -> None:
    """The device memory and pinned staging a method held, back before the next allocates its own."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        empty_host = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None)
        if empty_host is not None:
            empty_host()


def counted_window(engine, tokens: int) -> dict:
    """After the timed windows: host syncs per token over a short window counted on its own
    (CUDA's sync debug mode; the count is not in the timings), and whether a drafting tier's
    CUDA graphs fell back to eager. Not counted while drafting ahead: its worker thread's syncs
    would land in the caller's count by chance."""
    from dataclasses import replace

    from triforce.decoding.sync_count import SyncCounter

    graphs = {t.name: t.runner.report() for t in engine.levels if getattr(t, "runner", None) is not None}
    out = {"graph_fallbacks": sum(1 for g in graphs.values() if g["graph_failed"]),
           "graph_modes": sorted({g["mode"] for g in graphs.values()}), "syncs_per_token": None}
    if engine.ahead is not None or engine.lm.device.type != "cuda":
        return out
    hooks = engine.hooks
    engine.hooks = replace(hooks, sync_counter=SyncCounter())
    try:
        syncs = engine.generate(tokens, SamplingParams(), frozenset()).stats["host_syncs"]
    finally:
        engine.hooks = hooks
    out.update(syncs_per_token=syncs["per_token"], syncs_by_phase=syncs["by_phase"])
    return out


def _window_parts(result) -> dict:
    """What one timed window did: where a slow window's time went (on the H200, 2026-11-28, every
    triforce row's first window ran 2-3.6x its second: the trace's first full verifies reject, so
    window 1 took 4 of them and window 2 took 2)."""
    stats = result.stats
    return {"full_verifies": stats["full_verifies"], "rebuilds": stats["rebuilds"],
            "accepted": stats["accepted"], "tier_time_s": stats["tier_time_s"]}


def _ahead_share(windows) -> dict:
    """How many of the timed verifies were drafted ahead of, and how many of those drafts the next cycle kept."""
    rounds = sum(r.stats["draft_ahead_rounds"] for r in windows)
    kept = sum(r.stats["draft_ahead_kept"] for r in windows)
    return {"verifies": rounds, "kept": kept}


def _transfer_bytes(cache) -> tuple[int, int]:
    if isinstance(cache, OffloadedKVCache):
        return cache.prefetcher.stats.h2d_bytes, cache.prefetcher.stats.d2h_bytes
    if isinstance(cache, HostAttentionKVCache):
        return cache.h2d_bytes, cache.d2h_bytes
    return 0, 0
