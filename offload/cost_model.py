"""Predicted milliseconds per token from bytes moved, following MagicDec's formulation:

    per-token time = (T_verify + drafting time per verify) / expected tokens per verify

Every step of long-context decoding is bound by memory traffic: a full verify reads the weights
and the resident KV from device memory and the offloaded KV over PCIe; a retrieval-tier step
reads the weights and the retrieval cache; a tier-0 step the draft model and its small cache.
Acceptance is treated as independent per token with rate alpha, so a check of gamma drafts yields
(1 - alpha^(gamma+1)) / (1 - alpha) tokens on average."""
from __future__ import annotations

from dataclasses import dataclass

from triforce.offload.errors import OffloadError


@dataclass(frozen=True)
class Acceptance:
    """full: how often the full-cache target accepts a retrieval-tier token; retrieval: how often
    the retrieval tier accepts a tier-0 draft. Defaults are assumptions unless measured."""
    full: float = 0.9
    retrieval: float = 0.8
    measured: bool = False

    def __post_init__(self):
        for name in ("full", "retrieval"):
            if not 0 <= getattr(self, name) <= 1:
                raise OffloadError(f"acceptance '{name}' must be in [0, 1], got {getattr(self, name)}")


def expected_tokens(alpha: float, gamma: int) -> float:
    """Tokens emitted by one check of `gamma` drafts (accepted prefix + the correction/bonus)."""
    if alpha >= 1:
        return gamma + 1.0
    return (1 - alpha ** (gamma + 1)) / (1 - alpha)


def transfer_ms(num_bytes: float, gbps: float) -> float:
    return num_bytes / (gbps * 1e6)


@dataclass(frozen=True)
class StepTimes:
    """Floors of one step of each tier, in ms."""
    full_verify_ms: float
    tier1_ms: float
    tier0_ms: float


def step_times(*, weights_bytes: int, resident_kv_bytes: int, host_kv_bytes_per_link: int,
               retrieval_cache_bytes: int, draft_bytes: int, hbm_gbps: float, h2d_gbps: float) -> StepTimes:
    """draft_bytes: draft weights plus its cache (0 for prompt lookup)."""
    full = transfer_ms(host_kv_bytes_per_link, h2d_gbps) + transfer_ms(weights_bytes + resident_kv_bytes, hbm_gbps)
    tier1 = transfer_ms(weights_bytes + retrieval_cache_bytes, hbm_gbps)
    tier0 = transfer_ms(draft_bytes, hbm_gbps)
    return StepTimes(full, tier1, tier0)


def triforce_ms_per_token(times: StepTimes, acceptance: Acceptance, gamma1: int, gamma2: int,
                          has_tier0: bool) -> dict:
    """Predicted ms/token of the three-tier loop (two tiers when has_tier0 is False)."""
    per_verify = expected_tokens(acceptance.full, gamma2)
    if has_tier0:
        per_check = expected_tokens(acceptance.retrieval, gamma1)
        checks = gamma2 / per_check
        drafting = checks * (times.tier1_ms + gamma1 * times.tier0_ms)
    else:
        drafting = gamma2 * times.tier1_ms
    return {
        "triforce_ms_per_token": (times.full_verify_ms + drafting) / per_verify,
        "drafting_ms_per_verify": drafting,
        "expected_tokens_per_full_verify": per_verify,
    }
