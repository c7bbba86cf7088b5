"""What a generate call reports: per-level counts (the summary is Engine.summary)."""
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
