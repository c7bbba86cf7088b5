"""What a generate call reports: per-level counts and the summary built from them."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class LevelStats:
    proposed: int = 0
    accepted: int = 0
    rounds: int = 0
    emitted: int = 0

    def add(self, proposed: int, accepted: int) -> None:
        """One check: `proposed` drafts, `accepted` of them kept, one token of its own emitted."""
        self.proposed += proposed
        self.accepted += accepted
        self.rounds += 1
        self.emitted += accepted + 1


@dataclass
class GenerationResult:
    tokens: list[int]
    stopped_by: str  # eos | length | context | interrupt
    time_s: float
    stats: dict = field(default_factory=dict)


def summarize(engine, before: tuple[dict, int]) -> dict:
    """The statistics of the generate call that began when tier times and rebuilds were `before`."""
    times_before, rebuilds_before = before
    levels, stats = engine.levels, engine.stats
    top = stats[-1]
    checked = [(levels[i].name, s) for i, s in enumerate(stats) if i > 0]
    return {
        "tiers": engine.describe(),
        "acceptance_rates": {name: round(s.accepted / s.proposed, 4) for name, s in checked if s.proposed},
        "proposed": {name: s.proposed for name, s in checked},
        "accepted": {name: s.accepted for name, s in checked},
        "full_verifies": top.rounds,
        "gamma2": engine.gammas[-1] if len(levels) > 1 else None,
        "mean_tokens_per_full_verify": round(top.emitted / top.rounds, 4) if top.rounds else None,
        "tier_time_s": {t.name: round(t.time_s - times_before[t.name], 4) for t in levels},
        # during this call (the rebuild at set_sequence is not counted)
        "rebuilds": sum(t.rebuilds for t in engine.sparse_tiers) - rebuilds_before,
        # what --method auto's online check did
        **({} if engine.gate is None else {"auto_fallbacks": engine.gate.fallbacks,
                                           "auto_ar_tokens": engine.gate.ar_tokens}),
    }
