"""The memory planner: pure arithmetic from model shapes, a memory profile and a context length
to the bytes of every buffer on each GPU and on the host, and predicted ms/token.

All GPU figures are per GPU, for the rank with the largest share under tensor parallelism. The
KV of tokens [0, resident_tokens) of every layer stays on the GPU; the rest lives in the host KV
store and is streamed through two staging buffers during each full verify."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

from triforce.config import PREFILL_CHUNKS, PREFILL_GROUP, SpecParams
from triforce.config.model import ModelConfig
from triforce.plan.cost_model import (Acceptance, Hardware, StepCosts, full_verify_ms, tier0_ms, tier1_ms,
                                         triforce_ms_per_token)
from triforce.offload.errors import OffloadError
from triforce.plan.fit_advice import check_tp, too_big_reason
from triforce.offload.hybrid import HybridRates
from triforce.plan.blocks import ALIGN_TOKENS, align_up, choose_block_tokens, promoted_tokens
from triforce.plan.profiles import MemoryProfile, format_size
from triforce.offload.shapes import (LoadedBlocks, activation_bytes_per_token, block_bytes_per_weight,
                                     block_sums_bytes, drafting_graph_pool, full_tier_graph_pool,
                                     gather_staging_bytes, kv_bytes_per_token_layer, kv_heads_share,
                                     matmul_workspaces, weight_bytes)

DEFAULT_STAGING_BYTES = 32 << 20  # one staging buffer (K and V of one block): big copies, small footprint
MAX_SCORE_ELEMENTS = 1 << 22  # of a partial-attention tile (kernels/partial.py's, kept equal by a test: no torch here)


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
    budget = profile.device_budget_bytes
    weight_format = getattr(weights, "name", weights)
    per_token_layer = kv_bytes_per_token_layer(model, dtype_bytes, tp)
    per_token = per_token_layer * model.num_layers
    heads = kv_heads_share(model, tp) * (model.num_heads // model.num_kv_heads)
    fixed = {
        "target_weights": weight_bytes(model, dtype_bytes, tp, block_bytes_per_weight(weights, profile.num_gpus > 0)),
        "draft_weights": 0,
        "retrieval_cache": 0,
        "streaming_cache": 0,
    }
    if spec.uses_sparse_cache:
        fixed["retrieval_cache"] = per_token * (spec.budget + spec.sparse_append_slots)
    if draft is not None:
        d_bytes = draft_dtype_bytes or dtype_bytes
        fixed["draft_weights"] = weight_bytes(draft, d_bytes)
        slots = spec.sink_tokens + spec.draft_window_tokens + spec.draft_slack
        fixed["streaming_cache"] = slots * kv_bytes_per_token_layer(draft, d_bytes) * draft.num_layers
    verify_tokens = spec.gamma2 + 1
    activation_per_token = activation_bytes_per_token(model, dtype_bytes, tp)
    logits = 2 * max(verify_tokens, 1) * model.vocab_size * 4
    gather = 2 * spec.budget * per_token_layer if spec.uses_sparse_cache else 0  # during a rebuild
    gamma_slots = 2 * (spec.gamma1 + spec.gamma2_range[1]) if spec.uses_sparse_cache else 0
    gamma_bytes = logits + gamma_slots * per_token  # what a fit error blames on the gammas

    def workspace(chunk: int) -> int:
        return min(chunk, context) * activation_per_token + logits + gather

    fixed["matmul_workspaces"] = matmul_workspaces(budget if profile.num_gpus > 0 else 0, graphs, spec.uses_sparse_cache,
                                                   draft is not None, block_sums_bytes(model, weights, tp))
    graph_pool = drafting_graph_pool(model, spec, dtype_bytes, draft, draft_dtype_bytes, tp) if graphs else 0
    # a prefill keeps every layer's queries of its last token (SnapKV: of its observation window)
    # until the sparse cache is selected by them
    def kept_queries(chunk: int) -> int:
        return model.num_layers * heads * spec.selection_window * model.head_dim * dtype_bytes \
            if spec.uses_sparse_cache else 0
    # mean keys of retrieval chunks, kept beside resident keys (triforce.kernels.chunk_means)
    retrieval = spec.uses_sparse_cache and spec.sparse_policy == "retrieval"
    means_per_token = per_token // (2 * spec.chunk_size) if retrieval else 0
    resident_all = {**fixed, "workspace": workspace(PREFILL_CHUNKS[0]) + kept_queries(PREFILL_CHUNKS[0]),
                    "cuda_graph_pool": graph_pool + graphs * full_tier_graph_pool(
                        model, spec.longest_graph_step, spec.uses_sparse_cache, dtype_bytes, tp),
                    "staging_buffers": 0, "prefill_scratch": 0, "resident_kv": context * per_token,
                    "chunk_means": context * means_per_token}
    common = dict(profile=profile.name, context=context, tp=tp, gpu_budget_bytes=budget,
                  host_budget_bytes=profile.host_bytes)
    if sum(resident_all.values()) <= budget:
        plan = MemoryPlan(True, "", weight_format=weight_format, breakdown=resident_all, resident_tokens=context,
                          host_breakdown={"host_kv": 0}, block_tokens=0, prefill_chunk=PREFILL_CHUNKS[0],
                          decode_resident_tokens=context, **common)
        return _with_predictions(plan, model, profile, spec, dtype_bytes, draft, tp, acceptance, has_tier0)

    block = choose_block_tokens(per_token_layer, _staging_bytes(profile), context)
    staging = 2 * block * per_token_layer
    def tile_scores(queries: int) -> int:  # the largest score tile partial attention makes
        return min(MAX_SCORE_ELEMENTS, heads * min(queries, context) * context) * (8 if dtype_bytes == 8 else 4)

    def sizes():
        """(chunk, query group) from the largest down: a smaller group streams the host KV more
        often but is tried before a smaller chunk, which slows every projection."""
        for chunk in PREFILL_CHUNKS:
            group = min(align_up(context, chunk), max(chunk, PREFILL_GROUP // chunk * chunk))
            while True:
                yield chunk, group
                if group == chunk:
                    break
                group = max(chunk, group // 2 // chunk * chunk)

    def group_attention(group: int) -> int:
        """A layer-major query group: its queries and attention output (dtype), and the running
        merge and one block's partial result (float32, or float64)."""
        calc = 8 if dtype_bytes == 8 else 4
        return min(group, context) * heads * (model.head_dim * (2 * dtype_bytes + 2 * calc) + 2 * calc)

    # layer-major prefill: every prompt token's hidden state, its RoPE angles, one layer's new KV
    prefill_scratch = context * (model.hidden_size + 2 * model.head_dim + per_token_layer // dtype_bytes) * dtype_bytes
    for chunk, group in sizes():
        offload = {**fixed, "workspace": workspace(chunk) + tile_scores(group) + kept_queries(chunk)
                   + group_attention(group),
                   "cuda_graph_pool": graph_pool,
                   "staging_buffers": staging, "prefill_scratch": prefill_scratch}
        room = budget - sum(offload.values())
        if room >= 0:
            break
    if room < 0:
        scratch_per_token = prefill_scratch / context
        reason = too_big_reason(offload, budget, profile, model, tp, scratch_per_token, gamma_bytes)
        return MemoryPlan(False, reason, weight_format=weight_format, breakdown={**offload, "resident_kv": 0, "chunk_means": 0},
                          resident_tokens=0, host_breakdown={"host_kv": 0}, block_tokens=block,
                          prefill_chunk=chunk, prefill_group=group, **common)
    # below the context: this branch offloads (a plan that keeps every token resident is the one above)
    resident_tokens = min(context - 1, room // (per_token + means_per_token)) // ALIGN_TOKENS * ALIGN_TOKENS
    host_tokens = context - resident_tokens
    block = min(block, align_up(host_tokens))  # no block longer than the host range needs
    offload["staging_buffers"] = 2 * block * per_token_layer
    host_slots = -(-host_tokens // block) * block  # the host store holds whole blocks
    host = {"host_kv": host_slots * model.num_layers * 2 * model.num_kv_heads * model.head_dim * dtype_bytes,
            "host_staging": 0, "host_chunk_means": 0}
    if spec.uses_sparse_cache:
        host["host_staging"] = gather_staging_bytes(tp * spec.budget * per_token_layer, model.num_layers)
        if spec.sparse_policy == "retrieval":
            host["host_chunk_means"] = (host_tokens // spec.chunk_size) * model.num_layers \
                * model.num_kv_heads * model.head_dim * dtype_bytes
    breakdown = {**offload, "resident_kv": resident_tokens * per_token, "chunk_means": resident_tokens * means_per_token}
    reason = ""
    if sum(host.values()) > profile.host_bytes:
        per_host_token = sum(host.values()) / max(host_tokens, 1)
        fits = resident_tokens + int(profile.host_bytes / per_host_token)
        reason = (f"the offloaded KV needs {format_size(sum(host.values()))} of host memory but "
                  f"{format_size(profile.host_bytes)} is usable beside {profile.name}'s card: the longest context "
                  f"that fits is about {fits // 1024 * 1024} tokens (--max-context); else a model with fewer KV heads "
                  f"or layers, or a machine with more memory (plan one with `triforce plan --host-memory`)")
    if spec.method == "snapkv" and not reason:
        reason = ("snapkv selects by scoring every key of a layer on the device, which an offloaded "
                  "cache does not hold: use a context that fits the device, or --method streaming or retrieval")
    plan = MemoryPlan(not reason, reason, weight_format=weight_format, breakdown=breakdown, resident_tokens=resident_tokens,
                      host_breakdown=host, block_tokens=block, prefill_chunk=chunk, prefill_group=group,
                      decode_resident_tokens=resident_tokens + promoted_tokens(offload["prefill_scratch"],
                                                                              per_token, block, host_tokens),
                      **common)
    return _with_predictions(plan, model, profile, spec, dtype_bytes, draft, tp, acceptance, has_tier0)


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

