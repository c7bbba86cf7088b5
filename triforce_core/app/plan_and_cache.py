"""From flags to a memory plan and the full KV cache it calls for (resident or offloaded)."""
from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch

from triforce.config import AUTO, SpecParams

from triforce.config.model import ModelConfig
from triforce.errors import UserError
from triforce.plan.cost_model import Acceptance, Gamma1Controller, Gamma2Controller, RoundPrices
from triforce.plan.method_choice import MethodChoice, choose_method, default_acceptance
from triforce.plan.planner import MemoryPlan, hardware, plan_memory
from triforce.plan import host_limits
from triforce.plan.host_limits import this_cpu, with_host
from triforce.plan.profiles import HOST_UNBOUNDED, MemoryProfile, load_profile, parse_size
from triforce.plan.speculation_choice import Choice, plan_with_choice


def auto_profile(device: torch.device) -> MemoryProfile:
    """`cpu` with this machine's memory and cores on a CPU device (profiles.this_cpu); on CUDA, what the device reports now (bandwidths nominal until
    `triforce profile tune` measures them).

    Reserved is what others hold: the memory in use on the device less what this process's
    PyTorch allocator holds. The planner counts our own weights and caches itself, so the
    profile comes out the same before and after the models are loaded (counting loaded weights
    as reserved once refused Llama-3-8B bf16 on a 24 GB card)."""
    if device.type != "cuda":
        return this_cpu()
    if device.index is None:  # torch's memory-fraction query refuses it; resolve_device never returns one
        raise ValueError(f"auto_profile needs a CUDA device with its index (resolved by resolve_device), got {device}")
    free, total = torch.cuda.mem_get_info(device)
    in_use = max(0, total - free - torch.cuda.memory_reserved(device))
    # older torch releases have no such query: a cap cannot be read there, so the whole card counts
    query = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    fraction = query(device) if query is not None else 1.0
    return MemoryProfile(
        name=f"auto:{torch.cuda.get_device_name(device)}",
        description="read from the card at start, its rates nominal (PCIe 25 GB/s, memory 1000 GB/s), not "
                    "this card's: `triforce profile tune` measures them",
        num_gpus=torch.cuda.device_count(), gpu_bytes=int(total * min(fraction, 1.0)), reserved_bytes=in_use + (512 << 20),
        host_bytes=HOST_UNBOUNDED, pcie_h2d_gbps=25.0, pcie_d2h_gbps=25.0,
        hbm_gbps=1000.0, cpu_threads=os.cpu_count() or 1)


def resolve_profile(spec: str | None, device: torch.device, device_budget: str | None = None) -> MemoryProfile:
    """The profile a run plans with: named, or read from the device; a card's host side is this
    machine's memory as it is now (plan.host_limits), never what a profile assumes."""
    profile = load_profile(spec) if spec else auto_profile(device)
    if profile.num_gpus > 0:
        profile = with_host(profile, host_limits.host_memory())
    if device_budget is not None:
        profile = profile.with_device_budget(parse_size(device_budget, "--device-budget"))
    return profile


def make_plan(cfg: ModelConfig, profile: MemoryProfile, context: int, spec: SpecParams, dtype: torch.dtype,
              draft_cfg: ModelConfig | None = None, draft_dtype: torch.dtype | None = None,
              tp: int = 1, acceptance: Acceptance = Acceptance()) -> MemoryPlan:
    return plan_memory(cfg, profile, context, spec, dtype_bytes=_size(dtype), draft=draft_cfg,
                       draft_dtype_bytes=_size(draft_dtype) if draft_dtype is not None else None, tp=tp,
                       acceptance=acceptance)


@dataclass(frozen=True)
class RunPlan:
    plan: MemoryPlan
    spec: SpecParams                 # with the cost model's choices for the flags left out
    choice: Choice | None            # what the cost model chose (None: nothing to choose)
    profile: MemoryProfile
    auto: MethodChoice | None = None  # --method auto: the method chosen and why
    batch: object = None             # a batch's --method auto: its BatchChoice (triforce.plan.batch_choice)
    dtype_bytes: int | None = None   # the run's element size: the profile's rates scale with it
    gamma1_fixed: bool = False       # the user named gamma1: it stays as given

    def method_line(self) -> str | None:
        """What --method auto chose and why (None: the user named the method)."""
        choice = self.batch or self.auto
        return choice.describe() if choice is not None else None

    def method_json(self) -> dict | None:
        choice = self.batch or self.auto
        return choice.to_json() if choice is not None else None

    @property
    def speculate_from(self) -> int:
        """Sequence length below which the engine decodes as ar (auto only; 0: from the start)."""
        return self.auto.speculate_from if self.auto is not None else 0

    def speculation_gate(self):
        """--method auto's online check (None for a method the user named, or where the plan has
        no step costs to price rounds with)."""
        if self.auto is None or (self.auto.method == "ar" and not self.auto.probe) or self.plan.step_costs is None:
            return None
        from triforce.decoding.speculation_gate import PROBE_HOLD, SpeculationGate

        prices = RoundPrices(self.plan.step_costs, hardware(self.profile, self.dtype_bytes),
                             self.plan.decode_resident_tokens)
        return SpeculationGate(prices, self.speculate_from, ar_first=PROBE_HOLD if self.auto.probe else 0)

    def gamma1_controller(self, has_tier0: bool) -> Gamma1Controller | None:
        """Adapts the tier-0 drafts per retrieval check to their observed rate, unless named."""
        if self.gamma1_fixed or not has_tier0 or self.spec.method != "triforce" or self.plan.step_costs is None:
            return None
        return Gamma1Controller(self.plan.step_costs, hardware(self.profile, self.dtype_bytes), self.spec.gamma1)

    def gamma2_controller(self, has_tier0: bool) -> Gamma2Controller | None:
        """Adapts gamma2 to the observed acceptance when its range is open."""
        low, high = self.spec.gamma2_range
        if low == high or self.plan.step_costs is None or self.choice is None:
            return None
        return Gamma2Controller(self.plan.step_costs, hardware(self.profile, self.dtype_bytes), self.choice.acceptance,
                                self.spec.gamma1, has_tier0, (low, high))


def plan_run(cfg: ModelConfig, profile: MemoryProfile, context: int, spec: SpecParams, fixed: frozenset[str],
             dtype: torch.dtype, draft_cfg: ModelConfig | None = None, draft_dtype: torch.dtype | None = None,
             tp: int = 1, assumed: Acceptance | None = None, has_tier0: bool | None = None,
             weights=None) -> RunPlan:
    """The cost model's choices for the flags left open (the method too, for auto), and the
    memory plan for them."""
    auto = None
    if spec.method == AUTO:
        auto, spec = choose_method(cfg, profile, context, spec, fixed, dtype_bytes=_size(dtype), draft=draft_cfg,
                                   draft_dtype_bytes=_size(draft_dtype) if draft_dtype else None, tp=tp,
                                   has_tier0=bool(has_tier0) if has_tier0 is not None else True, weights=weights)
        if not spec.uses_draft:
            draft_cfg, draft_dtype, has_tier0 = None, None, False
    assumed = assumed or default_acceptance(profile)
    plan, spec, choice = plan_with_choice(cfg, profile, context, spec, fixed, dtype_bytes=_size(dtype),
                                          draft=draft_cfg, draft_dtype_bytes=_size(draft_dtype) if draft_dtype else None,
                                          tp=tp, assumed=assumed, has_tier0=has_tier0, weights=weights)
    return RunPlan(plan, spec, choice, profile, auto, dtype_bytes=_size(dtype), gamma1_fixed="gamma1" in fixed)


def _size(dtype: torch.dtype) -> int:
    return dtype.itemsize


def build_kv_cache(lm, max_len: int, plan: MemoryPlan | None, *, overlap: bool = True, hybrid: bool = True,
                   residency: bool = True, host_arena=None):
    """A ResidentKVCache when the plan keeps everything resident, else an OffloadedKVCache (its
    short passes split between PCIe and the CPU as the plan says, unless hybrid is False; the
    prefill's scratch holding host blocks once decoding starts, unless residency is False; its
    host store in `host_arena`'s bytes when given)."""
    from triforce.cache.resident import ResidentKVCache

    if plan is None or plan.resident_tokens >= max_len:
        cache = ResidentKVCache(lm.config, max_len, dtype=lm.dtype, device=lm.device, attn=lm.attn)
    else:
        from triforce.cache.offloaded import OffloadedKVCache

        cache = OffloadedKVCache(lm.config, max_len, plan.resident_tokens, plan.block_tokens, dtype=lm.dtype,
                                 device=lm.device, overlap=overlap, host_budget_bytes=plan.host_budget_bytes,
                                 attn=lm.attn, hybrid=plan.hybrid if hybrid else None,
                                 decode_resident_tokens=plan.decode_resident_tokens if residency else 0,
                                 host_arena=host_arena)
    return cache


def refuse_before_loading(config, device: torch.device, quantize: str | None) -> None:
    """On a card, a context whose KV cannot fit the card and this machine's memory is refused
    before a weight is read (the plan made after loading says the same, minutes later): planned
    from the model's shapes alone, the weights counted as --quantize holds them."""
    if device.type != "cuda":
        return  # a CPU's model and caches are checked against free memory as they are made
    from triforce.model.architectures import arch_config
    from triforce.model.context_stretch import run_context
    from triforce.model.loading import model_shape, resolve_dtype

    shape = arch_config(config.arch) if config.arch is not None else model_shape(config.model)[0]
    context = config.max_context if config.rope_scaling else run_context(shape.max_position_embeddings,
                                                                         config.max_context)
    weights = quantize
    if quantize == "gguf":
        from triforce.model.loading import gguf_file
        from triforce.offload.shapes import LoadedBlocks, matrix_weights

        path = gguf_file(config.model)
        weights = None if path is None else LoadedBlocks("gguf", path.stat().st_size / matrix_weights(shape))
    profile = resolve_profile(config.profile, device, config.device_budget)
    spec = config.spec if config.spec.method != AUTO else replace(config.spec, method="ar")  # the least KV
    plan = plan_run(shape, profile, context, spec, config.fixed, resolve_dtype(config.dtype, device),
                    has_tier0=False, weights=weights).plan
    if not plan.feasible and plan.host_bytes_total > plan.host_budget_bytes:
        raise UserError(f"a {context}-token context does not fit here (nothing was loaded): {plan.reason}")
