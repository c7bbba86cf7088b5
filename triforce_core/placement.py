"""From flags to a memory plan and the full KV cache it calls for (resident or offloaded)."""
from __future__ import annotations

import os

import torch

from triforce.config import ModelConfig, SpecParams
from triforce.offload.planner import MemoryPlan, plan_memory
from triforce.offload.profiles import MemoryProfile, load_profile, parse_size


def auto_profile(device: torch.device) -> MemoryProfile:
    """`cpu` on a CPU device; on CUDA, what the device reports now (bandwidths nominal until
    `triforce profile tune` measures them)."""
    if device.type != "cuda":
        return load_profile("cpu")
    import psutil

    free, total = torch.cuda.mem_get_info(device)
    in_use = total - free
    return MemoryProfile(
        name=f"auto:{torch.cuda.get_device_name(device)}", description="detected at start (nominal bandwidths)",
        num_gpus=torch.cuda.device_count(), gpu_bytes=total, reserved_bytes=in_use + (512 << 20),
        host_bytes=int(psutil.virtual_memory().available * 0.8), pcie_h2d_gbps=25.0, pcie_d2h_gbps=25.0,
        hbm_gbps=1000.0, cpu_threads=os.cpu_count() or 1)


def resolve_profile(spec: str | None, device: torch.device, device_budget: str | None = None) -> MemoryProfile:
    profile = load_profile(spec) if spec else auto_profile(device)
    if device_budget is not None:
        profile = profile.with_device_budget(parse_size(device_budget, "--device-budget"))
    return profile


def make_plan(cfg: ModelConfig, profile: MemoryProfile, context: int, spec: SpecParams, dtype: torch.dtype,
              draft_cfg: ModelConfig | None = None, draft_dtype: torch.dtype | None = None,
              tp: int = 1) -> MemoryPlan:
    size = torch.empty((), dtype=dtype).element_size()
    draft_size = torch.empty((), dtype=draft_dtype).element_size() if draft_dtype is not None else None
    return plan_memory(cfg, profile, context, spec, dtype_bytes=size, draft=draft_cfg,
                       draft_dtype_bytes=draft_size, tp=tp)


def build_kv_cache(lm, max_len: int, plan: MemoryPlan | None, *, overlap: bool = True):
    """A FullKVCache when the plan keeps everything resident, else an OffloadedKVCache."""
    from triforce.kv_cache import FullKVCache

    if plan is None or plan.resident_tokens >= max_len:
        cache = FullKVCache(lm.config, max_len, dtype=lm.dtype, device=lm.device)
    else:
        from triforce.offload.offloaded_cache import OffloadedKVCache

        cache = OffloadedKVCache(lm.config, max_len, plan.resident_tokens, plan.block_tokens, dtype=lm.dtype,
                                 device=lm.device, overlap=overlap, host_budget_bytes=plan.host_budget_bytes)
    if plan is not None:
        cache.prefill_chunk = plan.prefill_chunk  # what the plan sized activation memory for
    return cache
