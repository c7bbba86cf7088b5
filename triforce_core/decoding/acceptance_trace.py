"""Accept/reject sequences: recorded from a real model's run, replayed where weights are random.

Random-weight architectures time the real kernels of every tier but cannot accept drafts
honestly; replaying the accepted counts recorded from a real model gives them a real model's
rhythm of full verifies. A trace holds, per verifying level (by tier name), the (proposed,
accepted) count of each check, in order."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from triforce.decoding.verification import Verdict
from triforce.errors import UserError
from triforce.paths import write_atomically

TRACE_FORMAT = "triforce-acceptance-trace/1"


def save_trace(path: str | Path, rounds: list[tuple[str, int, int]], meta: dict) -> None:
    """rounds: (tier name, drafts proposed, drafts accepted) of each check, in order."""
    levels: dict[str, list[list[int]]] = {}
    for name, proposed, accepted in rounds:
        levels.setdefault(name, []).append([proposed, accepted])
    data = {"format": TRACE_FORMAT, **meta, "levels": levels}
    try:
        write_atomically(path, json.dumps(data, indent=1) + "\n")
    except OSError as e:
        raise UserError(f"cannot write the acceptance trace {path}: {e.strerror}") from None


def load_trace(path: str | Path) -> dict:
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"acceptance trace '{path}' does not exist (record one with "
                        "`triforce generate ... --record-acceptance FILE`)") from None
    except (OSError, ValueError) as e:
        raise UserError(f"cannot read the acceptance trace {path}: {e}") from None
    if not isinstance(data, dict) or data.get("format") != TRACE_FORMAT:
        raise UserError(f"{path} is not an acceptance trace (expected format {TRACE_FORMAT})")
    levels = data.get("levels")
    if not isinstance(levels, dict) or not levels or not all(
            isinstance(v, list) and v and all(isinstance(p, list) and len(p) == 2 for p in v)
            for v in levels.values()):
        raise UserError(f"acceptance trace {path} has no usable 'levels'")
    return data


class ReplayVerifier:
    """Decides each check by the next recorded accepted count of that level (cyclically),
    capped by the drafts actually proposed; the emitted token is the verifier's argmax."""

    def __init__(self, trace: dict):
        self.levels = {name: [int(a) for _, a in checks] for name, checks in trace["levels"].items()}
        self.position = {name: 0 for name in self.levels}

    def verdict(self, level: str, drafts: list[int], logits: torch.Tensor) -> Verdict:
        if level not in self.levels:
            raise UserError(f"the acceptance trace has no checks of tier '{level}' "
                            f"(it has {', '.join(self.levels)})")
        recorded = self.levels[level]
        accepted = min(recorded[self.position[level] % len(recorded)], len(drafts))
        self.position[level] += 1
        return Verdict(accepted, int(torch.argmax(logits[accepted])))


def trace_acceptance(trace: dict):
    """The acceptance a trace shows, as the cost model takes it: the full tier's per-token rate
    (from the share of drafts it kept, at the trace's gamma2) and the retrieval tier's kept share."""
    from triforce.plan.cost_model import Acceptance, rate_from_fraction

    def kept(level: str) -> float | None:
        checks = trace["levels"].get(level, [])
        proposed = sum(p for p, _ in checks)
        return sum(a for _, a in checks) / proposed if proposed else None

    full, retrieval = kept("full"), kept("retrieval")
    return Acceptance(full=rate_from_fraction(full, int(trace.get("gamma2", 8))) if full is not None else 0.9,
                      retrieval=retrieval if retrieval is not None else Acceptance().retrieval, measured=True)
