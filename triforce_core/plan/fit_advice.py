"""Why a request does not fit, and which changes could make it: only hints that can work."""
from __future__ import annotations

from triforce.config.model import ModelConfig
from triforce.offload.errors import OffloadError
from triforce.plan.profiles import MemoryProfile, format_size


def check_tp(tp: int, model: ModelConfig, profile: MemoryProfile) -> None:
    """The same limits generate and chat apply before starting ranks (triforce.app.parallel),
    with the profile's GPUs or cores standing for the machine's."""
    if tp > model.num_kv_heads:
        raise OffloadError(f"--tp {tp} cannot split the model's {model.num_kv_heads} KV heads "
                           f"(--tp at most {model.num_kv_heads})")
    if profile.num_gpus > 0 and tp > profile.num_gpus:
        raise OffloadError(f"--tp {tp} needs {tp} GPUs but profile {profile.name} has {profile.num_gpus}")
    if profile.num_gpus == 0 and tp > profile.cpu_threads:
        raise OffloadError(f"--tp {tp} on the CPU needs a core per rank but profile {profile.name} "
                           f"has {profile.cpu_threads}")


def too_big_reason(parts: dict, budget: int, profile: MemoryProfile, model: ModelConfig, tp: int,
                    scratch_per_token: float, gamma_bytes: int) -> str:
    """What does not fit, and only hints that can work: a --tp the profile's GPUs and the
    model's KV heads allow, never a GPU hint on the CPU profile, never a context past the
    model's own (max_position_embeddings: a stretched one where the run stretches it)."""
    need = sum(parts.values())
    biggest = max(parts, key=parts.get)
    hints = []
    without_scratch = need - parts["prefill_scratch"]
    if gamma_bytes > need // 4:  # verify logits and the sparse cache's room grow with the gammas
        hints.append(f"a smaller --gamma2 (what grows with it takes {format_size(gamma_bytes)})")
    if without_scratch < budget:  # only the context-sized prefill buffers do not fit
        fits = int((budget - without_scratch) / scratch_per_token)
        hints.append(f"a context of at most about {min(fits, model.max_position_embeddings)} tokens")
    wider = [n for n in range(tp + 1, profile.num_gpus + 1) if model.num_kv_heads % n == 0]
    if wider:
        hints.append(f"--tp {wider[-1]}")
    elif profile.num_gpus == 1 and tp == 1 and model.num_kv_heads % 2 == 0:
        hints.append("a two-GPU profile with --tp 2")
    hints += ["a smaller --budget or draft model", "a larger --device-budget"]
    return (f"weights and buffers need {format_size(need)} per device before any KV (largest: {biggest} "
            f"{format_size(parts[biggest])}) but the budget is {format_size(budget)}: try " + ", ".join(hints))
