"""The memory planner: pure arithmetic from model shapes, a memory profile and a context length
to the bytes of every buffer on each GPU and on the host, and predicted ms/token.

All GPU figures are per GPU, for the rank with the largest share under tensor parallelism. The
KV of tokens [0, resident_tokens) of every layer stays on the GPU; the rest lives in the host KV
store and is streamed through two staging buffers during each full verify."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from functools import partial

from triforce.config import PREFILL_CHUNKS, PREFILL_GROUP, SpecParams
from triforce.config.model import ModelConfig
from triforce.offload.errors import OffloadError
from triforce.offload.hybrid import HybridRates
from triforce.offload.shapes import (LoadedBlocks, block_bytes_per_weight, block_sums_bytes, drafting_graph_pool,
                                     full_tier_graph_pool, gather_staging_bytes, kv_bytes_per_token_layer,
                                     kv_heads_share, matmul_workspaces, weight_bytes)
from triforce.plan.blocks import ALIGN_TOKENS, align_up, choose_block_tokens, promoted_tokens
from triforce.plan.cost_model import (Acceptance, Hardware, StepCosts, full_verify_ms, tier0_ms, tier1_ms,
                                      triforce_ms_per_token)
from triforce.plan.fit_advice import check_tp, too_big_reason
from triforce.plan.profiles import MemoryProfile, format_size
from triforce.plan.sizes import PlanSizes

DEFAULT_STAGING_BYTES = 32 << 20  # one staging buffer (K and V of one block): big copies, small footprint


@dataclass(frozen=True)
class MemoryPlan:
    feasible: bool
    reason: str                       # why not, and what to change ("" when feasible)
    profile: str
    context: int
    tp: int
    gpu_budget_bytes: int             # per GPU
    breakdown: dict                   # per GPU, bytes by category
    resident_tokens: int
    host_breakdown: dict              # host bytes by category (all ranks)
    host_budget_bytes: int
    block_tokens: int                 # 0 when nothing is offloaded
    prefill_chunk: int                # tokens per prefill forward (bounds activation memory)
    prefill_group: int = PREFILL_GROUP  # queries per attention call of a layer-major prefill
    predictions: dict = field(default_factory=dict)
    step_costs: StepCosts | None = None  # what each tier's forward pass moves and computes
    hybrid: HybridRates | None = None    # the CPU's share of short passes' host KV (offload.hybrid); None: streamed
    # KV tokens on the GPU while decoding: the resident ones plus the whole host blocks the
    # prefill's freed scratch holds (OffloadedKVCache promotes them after prefill)
    decode_resident_tokens: int = 0
    weight_format: str | None = None   # the target's matrices as GGUF blocks of this format (None: --dtype)

    @property
    def gpu_bytes_total(self) -> int:
        return sum(self.breakdown.values())

    @property
    def resident_kv_bytes(self) -> int:
        return self.breakdown.get("resident_kv", 0)

    @property
    def host_kv_bytes(self) -> int:
        return self.host_breakdown.get("host_kv", 0)

    @property
    def host_bytes_total(self) -> int:
        return sum(self.host_breakdown.values())

    @property
    def offloaded(self) -> bool:
        return self.resident_tokens < self.context

    def to_json(self) -> dict:
        out = asdict(self)
        out.update(gpu_bytes_total=self.gpu_bytes_total, resident_kv_bytes=self.resident_kv_bytes,
                   host_kv_bytes=self.host_kv_bytes, host_bytes_total=self.host_bytes_total,
                   offloaded=self.offloaded)
        return out


def plan_memory(model: ModelConfig, profile: MemoryProfile, context: int, spec: SpecParams, *,
                dtype_bytes: int, draft: ModelConfig | None = None, draft_dtype_bytes: int | None = None,
                tp: int = 1, graphs: bool | None = None, acceptance: Acceptance = Acceptance(),
                has_tier0: bool | None = None, weights: "str | LoadedBlocks | None" = None) -> MemoryPlan:
    """Place weights, caches and as much KV as fits on each GPU; the rest of the KV on the host.
    has_tier0: whether a tier-0 drafter (a draft model, or prompt lookup at no cost) feeds the
    retrieval tier; default: whether a draft model is given. weights: the target's matrices as
    GGUF blocks of that format (`--quantize`; the draft stays float), counted as the profile's
    device holds them (block_bytes_per_weight), or a loaded model's blocks as measured."""
    has_tier0 = draft is not None if has_tier0 is None else has_tier0
    if context < 1:
        raise OffloadError("the context must be at least one token")
    if tp < 1:
        raise OffloadError(f"--tp must be >= 1, got {tp}")
    check_tp(tp, model, profile)
    graphs = profile.num_gpus > 0 if graphs is None else graphs
    sizes = PlanSizes(model, spec, context, dtype_bytes, tp)
    fixed = _fixed_bytes(sizes, profile, weights, draft, draft_dtype_bytes, graphs)
    graph_pool = drafting_graph_pool(model, spec, dtype_bytes, draft, draft_dtype_bytes, tp) if graphs else 0
    common = dict(profile=profile.name, context=context, tp=tp, gpu_budget_bytes=profile.device_budget_bytes,
                  host_budget_bytes=profile.host_bytes, weight_format=getattr(weights, "name", weights))
    predicted = partial(_with_predictions, model=model, profile=profile, spec=spec, dtype_bytes=dtype_bytes,
                        draft=draft, tp=tp, acceptance=acceptance, has_tier0=has_tier0)
    resident = _all_resident(sizes, fixed, graph_pool + graphs * full_tier_graph_pool(
        model, spec.longest_graph_step, spec.uses_sparse_cache, dtype_bytes, tp))
    if sum(resident.values()) <= profile.device_budget_bytes:
        return predicted(MemoryPlan(True, "", breakdown=resident, resident_tokens=context, host_breakdown={"host_kv": 0},
                                    block_tokens=0, prefill_chunk=PREFILL_CHUNKS[0], decode_resident_tokens=context,
                                    **common))
    return _offloaded(sizes, profile, fixed, graph_pool, common, predicted)


def _fixed_bytes(sizes: PlanSizes, profile: MemoryProfile, weights, draft: ModelConfig | None,
                 draft_dtype_bytes: int | None, graphs: bool) -> dict:
    """What the device holds whatever the context: weights, the drafting tiers' caches, workspaces."""
    model, spec = sizes.model, sizes.spec
    on_gpu = profile.num_gpus > 0
    fixed = {"target_weights": weight_bytes(model, sizes.dtype_bytes, sizes.tp, block_bytes_per_weight(weights, on_gpu)),
             "draft_weights": 0, "retrieval_cache": 0, "streaming_cache": 0}
    if spec.uses_sparse_cache:
        fixed["retrieval_cache"] = sizes.per_token * (spec.budget + spec.sparse_append_slots)
    if draft is not None:
        d_bytes = draft_dtype_bytes or sizes.dtype_bytes
        fixed["draft_weights"] = weight_bytes(draft, d_bytes)
        slots = spec.sink_tokens + spec.draft_window_tokens + spec.draft_slack
        fixed["streaming_cache"] = slots * kv_bytes_per_token_layer(draft, d_bytes) * draft.num_layers
    fixed["matmul_workspaces"] = matmul_workspaces(profile.device_budget_bytes if on_gpu else 0, graphs,
                                                   spec.uses_sparse_cache, draft is not None,
                                                   block_sums_bytes(model, weights, sizes.tp))
    return fixed


def _all_resident(sizes: PlanSizes, fixed: dict, graph_pool: int) -> dict:
    """The device's bytes with every token's KV on it (chunked prefill, no staging)."""
    return {**fixed, "workspace": sizes.workspace(PREFILL_CHUNKS[0]), "cuda_graph_pool": graph_pool,
            "staging_buffers": 0, "prefill_scratch": 0, "resident_kv": sizes.context * sizes.per_token,
            "chunk_means": sizes.context * sizes.means_per_token}


def _offloaded(sizes: PlanSizes, profile: MemoryProfile, fixed: dict, graph_pool: int, common: dict,
               predicted) -> MemoryPlan:
    """The largest prefill sizes whose buffers fit, then as many resident tokens as the room left
    holds (aligned, below the context: the resident plan was the one above); the rest on the host."""
    budget, per_token, per_token_layer = profile.device_budget_bytes, sizes.per_token, sizes.per_token_layer
    block = choose_block_tokens(per_token_layer, _staging_bytes(profile), sizes.context)
    for chunk, group in sizes.prefill_sizes():
        device = {**fixed, "workspace": sizes.workspace(chunk) + sizes.group_attention(group),
                  "cuda_graph_pool": graph_pool, "staging_buffers": 2 * block * per_token_layer,
                  "prefill_scratch": sizes.prefill_scratch}
        room = budget - sum(device.values())
        if room >= 0:
            break
    if room < 0:
        reason = too_big_reason(device, budget, profile, sizes.model, sizes.tp, sizes.prefill_scratch / sizes.context,
                                sizes.gamma_bytes)
        return MemoryPlan(False, reason, breakdown={**device, "resident_kv": 0, "chunk_means": 0}, resident_tokens=0,
                          host_breakdown={"host_kv": 0}, block_tokens=block, prefill_chunk=chunk, prefill_group=group,
                          **common)
    resident_tokens = min(sizes.context - 1, room // (per_token + sizes.means_per_token)) // ALIGN_TOKENS * ALIGN_TOKENS
    host_tokens = sizes.context - resident_tokens
    block = min(block, align_up(host_tokens))  # no block longer than the host range needs
    device["staging_buffers"] = 2 * block * per_token_layer
    host = _host_bytes(sizes, host_tokens, block)
    reason = _host_reason(sizes, profile, host, host_tokens, resident_tokens)
    breakdown = {**device, "resident_kv": resident_tokens * per_token,
                 "chunk_means": resident_tokens * sizes.means_per_token}
    moved = promoted_tokens(device["prefill_scratch"], per_token, block, host_tokens)
    return predicted(MemoryPlan(not reason, reason, breakdown=breakdown, resident_tokens=resident_tokens,
                                host_breakdown=host, block_tokens=block, prefill_chunk=chunk, prefill_group=group,
                                decode_resident_tokens=resident_tokens + moved, **common))


def _host_bytes(sizes: PlanSizes, host_tokens: int, block: int) -> dict:
    """The host's part: whole KV blocks, a retrieval gather's staging, host chunks' mean keys."""
    model, spec = sizes.model, sizes.spec
    host_slots = -(-host_tokens // block) * block  # the host store holds whole blocks
    host = {"host_kv": host_slots * model.num_layers * 2 * model.num_kv_heads * model.head_dim * sizes.dtype_bytes,
            "host_staging": 0, "host_chunk_means": 0}
    if spec.uses_sparse_cache:
        host["host_staging"] = gather_staging_bytes(sizes.tp * spec.budget * sizes.per_token_layer, model.num_layers)
        if spec.sparse_policy == "retrieval":
            host["host_chunk_means"] = (host_tokens // spec.chunk_size) * model.num_layers \
                * model.num_kv_heads * model.head_dim * sizes.dtype_bytes
    return host


def _host_reason(sizes: PlanSizes, profile: MemoryProfile, host: dict, host_tokens: int, resident_tokens: int) -> str:
    """Why an offloaded plan cannot run ('' when it can)."""
    if sum(host.values()) > profile.host_bytes:
        per_host_token = sum(host.values()) / max(host_tokens, 1)
        fits = resident_tokens + int(profile.host_bytes / per_host_token)
        return (f"the offloaded KV needs {format_size(sum(host.values()))} of host memory but "
                f"{format_size(profile.host_bytes)} is usable beside {profile.name}'s card: the longest context "
                f"that fits is about {fits // 1024 * 1024} tokens (--max-context); else a model with fewer KV heads "
                f"or layers, or a machine with more memory (plan one with `triforce plan --host-memory`)")
    if sizes.spec.method == "snapkv":
        return ("snapkv selects by scoring every key of a layer on the device, which an offloaded "
                "cache does not hold: use a context that fits the device, or --method streaming or retrieval")
    return ""


def _staging_bytes(profile: MemoryProfile) -> int:
    value = dict(profile.extras).get("staging_block_bytes")
    return int(value) if isinstance(value, int) and value > 0 else DEFAULT_STAGING_BYTES


def step_costs(plan: "MemoryPlan", model: ModelConfig, spec: SpecParams, dtype_bytes: int,
               draft: ModelConfig | None, tp: int) -> StepCosts:
    """What one forward pass of each tier moves and computes on a GPU of this plan."""
    b = plan.breakdown
    per_token = kv_bytes_per_token_layer(model, dtype_bytes, tp) * model.num_layers
    resident = plan.decode_resident_tokens or plan.resident_tokens
    heads = kv_heads_share(model, tp) * (model.num_heads // model.num_kv_heads)
    draft_params = weight_bytes(draft, 1) if draft is not None else 0
    return StepCosts(
        num_layers=model.num_layers, weights_bytes=b["target_weights"], resident_kv_bytes=resident * per_token,
        host_kv_bytes=(plan.context - resident) * per_token,
        retrieval_kv_bytes=(spec.budget + spec.gamma2 + 1) * per_token if spec.uses_sparse_cache else 0,
        draft_bytes=b["draft_weights"] + b["streaming_cache"], draft_layers=draft.num_layers if draft else 0,
        flops_per_token=2 * weight_bytes(model, 1, tp), draft_flops_per_token=2 * draft_params,
        attention_flops_per_key=4 * model.num_layers * heads * model.head_dim,
        context=plan.context, budget=spec.budget, kv_group=model.num_heads // model.num_kv_heads,
        element_bytes=dtype_bytes, weights_format=plan.weight_format)


_ELEMENT_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8}


def hardware(profile: MemoryProfile, dtype_bytes: int | None = None, hybrid: bool = True) -> Hardware:
    """The profile's rates for a run whose elements take `dtype_bytes`. A profile measured in a
    narrower dtype (its `measured_dtype`, written by `profile tune`) overstates the arithmetic
    rate of a wider one: on a CPU a vector instruction does half as many float32 products as
    bfloat16 ones (0.055 against 0.114 TFLOP/s at 16 rows on the cpu profile's machine), so the
    rates are scaled by the width ratio; bytes/s are the same for any dtype."""
    measured = _ELEMENT_BYTES.get(str(dict(profile.extras).get("measured_dtype", "")))
    scale = measured / dtype_bytes if measured and dtype_bytes and dtype_bytes > measured else 1.0
    rate = lambda tflops: None if tflops is None else tflops * scale  # noqa: E731
    # hybrid (offload.hybrid): on a GPU whose profile has CPU rates (a CPU profile's device is the CPU)
    cpu = hybrid and profile.num_gpus > 0 and profile.host_attention_gbps is not None
    return Hardware(profile.hbm_gbps, profile.pcie_h2d_gbps, rate(profile.compute_tflops), profile.layer_overhead_us,
                    profile.attention_gbps, rate(profile.attention_tflops),
                    cpu_attention_gbps=profile.host_attention_gbps if cpu else None,
                    cpu_attention_tflops=rate(profile.host_attention_tflops) if cpu else None,
                    block_gbps=profile.block_gbps, block_tflops=profile.block_tflops)


def _with_predictions(plan: MemoryPlan, model: ModelConfig, profile: MemoryProfile, spec: SpecParams,
                      dtype_bytes: int, draft: ModelConfig | None, tp: int, acceptance: Acceptance,
                      has_tier0: bool) -> MemoryPlan:
    costs = step_costs(plan, model, spec, dtype_bytes, draft, tp)
    hw = hardware(profile, dtype_bytes)
    ar = full_verify_ms(costs, hardware(profile, dtype_bytes, hybrid=False), 1)  # the paper's baseline
    spec_part = triforce_ms_per_token(costs, hw, acceptance, spec.gamma1, spec.gamma2, has_tier0=has_tier0)
    rates = HybridRates.of(hw, costs)
    verify_share = rates.cpu_share(spec.gamma2 + 1) if rates and costs.host_kv_bytes else 0.0
    predictions = {
        "ar_offload_ms_per_token": round(ar, 3),
        "triforce_ms_per_token": round(spec_part["triforce_ms_per_token"], 3),
        "full_verify_ms": round(spec_part["full_verify_ms"], 3),
        "tier1_step_ms": round(tier1_ms(costs, hw, spec.gamma1 + 1 if has_tier0 else 1), 4),
        "tier0_step_ms": round(tier0_ms(costs, hw), 4),
        "drafting_ms_per_verify": round(spec_part["drafting_ms_per_verify"], 3),
        "expected_tokens_per_full_verify": round(spec_part["expected_tokens_per_full_verify"], 3),
        "pcie_bytes_per_full_verify": int(costs.host_kv_bytes * (1 - verify_share)),
        "acceptance": {"full": acceptance.full, "retrieval": acceptance.retrieval,
                       "measured": acceptance.measured},
        "gamma1": spec.gamma1, "gamma2": spec.gamma2, "budget": spec.budget, "chunk_size": spec.chunk_size,
    }
    if rates is not None and costs.host_kv_bytes:
        ar_hybrid = full_verify_ms(costs, hw, 1)
        predictions.update(ar_hybrid_ms_per_token=round(ar_hybrid, 3), hybrid_cpu_share_verify=round(verify_share, 3),
                           hybrid_cpu_share_ar=round(rates.cpu_share(1), 3))
    if predictions["triforce_ms_per_token"] > 0:
        predictions["predicted_speedup"] = round(ar / spec_part["triforce_ms_per_token"], 2)
    return replace(plan, predictions=predictions, step_costs=costs,
                   hybrid=rates if costs.host_kv_bytes else None)

