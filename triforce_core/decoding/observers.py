"""A round of the engine, and what the optional parts of decoding hear of it.

Engine.step plans a round (whether the full tier checks drafts, and how many), runs it (the
checks from the bottom tier up) and commits it (a stop token cuts it, the caches' upkeep, the
next gamma). The parts a run may or may not have are Observers told at each of those points:
--method auto's gate (decoding.speculation_gate), the log-probabilities an API asked for
(decoding.logprobs), the drafting-ahead tally (decoding.draft_ahead). The loop itself names none
of them."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Round:
    """One round: what the plan decided, then what it emitted and how long it took (the caches'
    upkeep included, as the gate prices it)."""
    base: int          # the sequence's length when it began (its last token pending)
    limit: int         # tokens it may emit at most
    first: bool        # the generate call's first round
    speculate: bool    # the full tier checks drafts (else it emits one token, as ar)
    gamma2: int        # the drafts the full tier is asked to check when it speculates
    started: float     # time.perf_counter() at the plan
    passes: list[tuple[str, int]] = field(default_factory=list)  # (tier kind, tokens fed) of its forwards
    emitted: int = 0   # tokens kept (a stop token ends them)
    drafted: bool = False  # it speculated with a tier below the full one
    seconds: float = 0.0


class Observer:
    """A part of decoding an engine tells about each generate call and round. Every method is
    optional; the engine calls them in this order."""

    def started(self, params) -> None:
        """A generate call begins, sampling as `params` (a config.SamplingParams) says."""

    def planning(self, plan: Round) -> None:
        """May turn the round's speculation off (plan.speculate) or ask fewer drafts (plan.gamma2)."""

    def full_logits(self, logits, tokens: list[int]) -> None:
        """The full model's logit rows [n, V] of the n tokens a check emitted, before a stop token
        cuts the round."""

    def committed(self, plan: Round) -> None:
        """The round is kept: plan.emitted tokens, in plan.seconds."""

    def report(self) -> dict:
        """What this part adds to the generate call's statistics."""
        return {}
