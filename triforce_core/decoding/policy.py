"""The decisions a decoding loop makes from what it has seen: when to rebuild the retrieval
cache and how many tokens to propose to the next full verify (SpeculationPolicy: no model, so
the rules are tested on their own), and the upkeep that carries them out on the sparse tiers."""
from __future__ import annotations

from collections import deque

from triforce.config import SpecParams
from triforce.decoding.full_tier import latest

ROLLING_ROUNDS = 8  # full verifies in the rolling acceptance that can trigger a rebuild
TIER0_CHECKS = 8    # the retrieval tier's latest checks of tier-0 drafts that estimate their rate
TIER0_EVIDENCE = 8  # drafts whose fate is known (kept, or the refused one) before that rate speaks
GAMMA1_PROBE = 8    # where checking tier-0 drafts does not pay: one draft every this many checks


class SpeculationPolicy:
    """Keeps the full tier's acceptance over the last ROLLING_ROUNDS verifies.

    A sparse cache is rebuilt when it has taken `rebuild_stride` tokens since its selection
    (stale), or when the rolling acceptance, over at least a full round's drafts, falls below
    `rebuild_threshold` once it has taken at least two verifies' worth (struggling). gamma2
    follows the controller (the cost model's choice at the rolling acceptance) when there is one,
    else stays where it started; gamma1 likewise follows its own controller at the rate of tier 0's
    drafts in the retrieval tier's latest checks."""

    def __init__(self, spec: SpecParams, gamma2_controller=None, drafts_ahead: bool = False, gamma1_controller=None):
        self.spec = spec
        self.drafts_ahead = drafts_ahead  # the tier below the full one drafts a second cycle during each verify
        self.controller = gamma2_controller
        self.gamma1_controller = gamma1_controller
        self.gamma2 = spec.gamma2
        self._rolling: deque[tuple[int, int]] = deque(maxlen=ROLLING_ROUNDS)
        self._tier0: deque[tuple[int, int]] = deque(maxlen=TIER0_CHECKS)  # (drafts kept, 1 if one was refused)
        self._without_drafts = 0  # checks since tier 0's last draft was offered, where none pays
        self._probe = False       # the check under way is such a single draft

    def full_verified(self, proposed: int, accepted: int) -> None:
        self._rolling.append((proposed, accepted))

    @property
    def rolling_acceptance(self) -> float | None:
        proposed = sum(p for p, _ in self._rolling)
        return sum(a for _, a in self._rolling) / proposed if proposed else None

    def should_rebuild(self, appended: int) -> bool:
        """Whether a sparse cache that has taken `appended` tokens since its selection is due. The
        acceptance speaks once the window holds a full round's drafts: --method auto's probes of
        one draft rebuilt a 26K selection after a lost probe (68 ms beside ar steps of 73 ms,
        Zen 3), on the word of a single rejected draft."""
        if appended >= self.spec.rebuild_stride:
            return True
        proposed = sum(p for p, _ in self._rolling)
        return (proposed >= max(self.spec.gamma2, 1) and appended >= 2 * self.spec.gamma2
                and sum(a for _, a in self._rolling) / proposed < self.spec.rebuild_threshold)

    def rebuilt(self) -> None:
        """A fresh selection: the acceptance seen with the old one no longer speaks for it."""
        self._rolling.clear()

    def tier0_checked(self, proposed: int, accepted: int) -> None:
        """The retrieval tier's check of `proposed` tier-0 drafts kept `accepted` of them."""
        if proposed:
            self._tier0.append((accepted, int(accepted < proposed)))
            if self._probe and accepted == proposed:
                self._without_drafts = GAMMA1_PROBE  # a kept probe: the next check probes again
        self._probe = False

    def next_gamma1(self) -> int:
        """Tier-0 drafts for the retrieval tier's next check: the controller's pick at their rate
        (kept / (kept + refused): a check stops at its first refusal), the planned gamma1 until
        TIER0_EVIDENCE drafts speak. Where it picks none, one draft every GAMMA1_PROBE checks (and
        after each kept one) keeps watch for text that starts repeating itself."""
        if self.gamma1_controller is None:
            return self.spec.gamma1
        kept = sum(k for k, _ in self._tier0)
        seen = kept + sum(refused for _, refused in self._tier0)
        if seen < TIER0_EVIDENCE:
            return self.spec.gamma1
        gamma1 = min(self.gamma1_controller.choose(kept / seen), self.spec.gamma1)
        if gamma1 == 0:
            self._without_drafts += 1
            self._probe = self._without_drafts >= GAMMA1_PROBE
            if self._probe:
                self._without_drafts, gamma1 = 0, 1
        return gamma1

    def next_gamma2(self) -> int:
        rolling = self.rolling_acceptance
        if self.controller is not None and rolling is not None:
            self.gamma2 = self.controller.choose(rolling)
        return self.gamma2

    def room_needed(self) -> int:
        """Tokens a sparse cache must have room for before a round starts (two cycles' when
        drafting ahead: SpecParams.sparse_append_slots leaves room for them)."""
        one_cycle = self.spec.gamma1 + self.spec.gamma2_range[1] + 2
        return 2 * one_cycle if self.drafts_ahead else one_cycle


class SparseUpkeep:
    """Keeps the sparse tiers in step with the full cache: the exact KV of committed tokens after
    each full verify, a rebuild from the latest committed tokens' queries when the policy says so
    or a tier runs out of room (the last token's for retrieval, SnapKV's observation window). A
    rebuild the policy asks for waits for the next round that drafts through the tiers: where
    --method auto's gate goes to ar next, it is not made at all."""

    def __init__(self, tiers: list, full, policy: SpeculationPolicy, window: int = 1):
        self.tiers, self.full, self.policy, self.window = tiers, full, policy, window
        self.latest_queries = None  # per layer [B, H, <= window, D], of the last committed tokens
        self.behind: int | None = None  # committed tokens from here on are not in the tiers yet
        self.due: list = []  # tiers the policy found due a rebuild, rebuilt before they next draft

    def start(self, queries) -> None:
        """A new sequence: select from the whole full cache with its last tokens' queries."""
        self.latest_queries, self.behind = queries, None
        for tier in self.tiers:
            self._rebuild(tier)

    def make_room(self, catch_up: int | None = None) -> None:
        """Before a round; catch_up: the committed length, where the round drafts through the tiers."""
        if catch_up is not None:
            self.catch_up(catch_up)
            for tier in list(self.due):
                self._rebuild(tier)
                self.policy.rebuilt()
        for tier in self.tiers:
            if tier.cache.room < self.policy.room_needed():
                self._rebuild(tier)

    def after_full_verify(self, committed_before: int, committed: int, queries, drafted: bool = True) -> None:
        """queries: the verify pass's, one row per token it fed from committed_before on.
        drafted: whether the round drafted through the tiers. An ar step (--method auto's check
        found speculation slower) leaves them as they are until catch_up: kept in step, a low
        acceptance rebuilt a selection every few ar steps, each rebuild costing many steps
        (bench/history/2026-11-28-long-document-server.md)."""
        if not self.tiers:
            return
        rows = committed - committed_before  # the committed tokens' rows in the verify pass
        if queries is not None and 0 < rows <= queries[0].shape[2]:
            fresh = [q[:, :, :rows] for q in queries]
            self.latest_queries = fresh if self.latest_queries is None else \
                [latest(old, new, self.window) for old, new in zip(self.latest_queries, fresh)]
        if not drafted:
            self.behind = committed_before if self.behind is None else self.behind
            return
        for tier in self.tiers:
            self._commit(tier, committed_before, committed)

    def catch_up(self, committed: int) -> None:
        """Before a round that drafts through the tiers: what ar steps committed meanwhile (a
        rebuild, which selects from the whole full cache, where a tier lacks the room)."""
        if self.behind is not None:
            start, self.behind = self.behind, None
            for tier in self.tiers:
                if tier.cache.room < committed - start + self.policy.room_needed():
                    self._rebuild(tier)
                else:
                    self._commit(tier, start, committed)

    def _commit(self, tier, start: int, end: int) -> None:
        tier.commit(self.full.cache, start, end)
        if tier not in self.due and self.policy.should_rebuild(tier.cache.appended):
            self.due.append(tier)

    def _rebuild(self, tier) -> None:
        if tier in self.due:
            self.due.remove(tier)
        queries = self.latest_queries
        if queries is not None and not tier.cache.policy.by_window:
            queries = [q[:, :, -1] for q in queries]  # retrieval (and top-k) select by the last token
        tier.rebuild(self.full.cache, queries)
