"""The speculation policy's decisions, without a model: rebuilds when stale or struggling (made
before the next round that drafts), the rolling window, gamma2 following its controller, and
gamma1 following the rate of tier 0's drafts."""
from types import SimpleNamespace

from triforce.config import SpecParams
from triforce.decoding.policy import GAMMA1_PROBE, ROLLING_ROUNDS, TIER0_EVIDENCE, SparseUpkeep, SpeculationPolicy


def spec(**kw):
    return SpecParams(**{"method": "triforce", "rebuild_stride": 100, "rebuild_threshold": 0.5, "gamma2": 4, **kw})


def test_a_stale_cache_is_rebuilt_whatever_the_acceptance():
    policy = SpeculationPolicy(spec())
    assert not policy.should_rebuild(99)
    assert policy.should_rebuild(100)
    policy.full_verified(4, 4)
    assert policy.should_rebuild(100) and not policy.should_rebuild(20)


class CountingTier:
    """A sparse tier's upkeep calls: committed tokens since its selection, and its rebuilds."""

    def __init__(self):
        self.cache = SimpleNamespace(appended=0, room=1000, policy=SimpleNamespace(by_window=False))
        self.rebuilds = 0

    def commit(self, full, start, end):
        self.cache.appended += end - start

    def rebuild(self, full, queries):
        self.rebuilds, self.cache.appended = self.rebuilds + 1, 0


def test_a_due_rebuild_waits_for_the_next_round_that_drafts():
    """--method auto's gate may go to ar after the verify that made a rebuild due: the rebuild
    (68-100 ms at 26K keys on a CPU, about an ar step) then waits for speculation's return."""
    tier = CountingTier()
    upkeep = SparseUpkeep([tier], SimpleNamespace(cache=None), SpeculationPolicy(spec(rebuild_stride=6)))
    upkeep.start(None)
    upkeep.make_room(catch_up=0)
    upkeep.after_full_verify(0, 5, None)
    upkeep.make_room(catch_up=5)
    upkeep.after_full_verify(5, 10, None)  # 10 tokens since the selection: due
    assert tier.rebuilds == 1 and tier.cache.appended == 10
    for length in range(10, 14):  # ar steps: nothing rebuilt, nothing fed
        upkeep.make_room()
        upkeep.after_full_verify(length, length + 1, None, drafted=False)
    assert tier.rebuilds == 1 and tier.cache.appended == 10
    upkeep.make_room(catch_up=14)  # speculation again: caught up, then rebuilt once
    assert tier.rebuilds == 2 and tier.cache.appended == 0 and not upkeep.due
    upkeep.after_full_verify(14, 16, None)
    upkeep.make_room(catch_up=16)
    assert tier.rebuilds == 2 and tier.cache.appended == 2


def test_a_struggling_cache_is_rebuilt_once_it_has_taken_two_verifies():
    policy = SpeculationPolicy(spec())
    assert policy.rolling_acceptance is None and not policy.should_rebuild(50)  # nothing seen yet
    policy.full_verified(4, 1)
    assert policy.rolling_acceptance == 0.25
    assert not policy.should_rebuild(7)   # fewer than 2 * gamma2 tokens since the selection
    assert policy.should_rebuild(8)
    policy.rebuilt()
    assert policy.rolling_acceptance is None and not policy.should_rebuild(8)


def test_a_few_rejected_drafts_are_no_word_on_the_cache_until_they_make_a_round():
    """--method auto's probes check one or two drafts: one rejection is not a struggling cache."""
    policy = SpeculationPolicy(spec())
    policy.full_verified(1, 0)
    assert policy.rolling_acceptance == 0.0 and not policy.should_rebuild(50)
    policy.full_verified(2, 0)
    assert not policy.should_rebuild(50)
    policy.full_verified(1, 1)
    assert policy.rolling_acceptance == 0.25 and policy.should_rebuild(50)  # four drafts: a round's worth


def test_the_rolling_window_forgets_old_verifies():
    policy = SpeculationPolicy(spec())
    policy.full_verified(4, 0)
    for _ in range(ROLLING_ROUNDS):
        policy.full_verified(4, 4)
    assert policy.rolling_acceptance == 1.0


def test_gamma2_follows_the_controller_at_the_rolling_acceptance():
    class Controller:
        def __init__(self):
            self.seen = []

        def choose(self, observed):
            self.seen.append(observed)
            return 8 if observed > 0.7 else 2

    controller = Controller()
    policy = SpeculationPolicy(spec(gamma2_min=2, gamma2_max=8), controller)
    assert policy.next_gamma2() == 4 and controller.seen == []  # no acceptance seen: the start value
    policy.full_verified(4, 4)
    assert policy.next_gamma2() == 8
    policy.full_verified(8, 0)
    assert policy.next_gamma2() == 2 and controller.seen == [1.0, 4 / 12]
    assert SpeculationPolicy(spec()).next_gamma2() == 4  # no controller: gamma2 stays


def test_room_needed_covers_a_round_at_the_largest_gamma2():
    assert SpeculationPolicy(spec(gamma1=3, gamma2_min=2, gamma2_max=8)).room_needed() == 3 + 8 + 2


class ByRate:
    """A gamma1 controller: none below half kept, else 6 (more than the plan's gamma1)."""

    def __init__(self):
        self.seen = []

    def choose(self, alpha):
        self.seen.append(alpha)
        return 6 if alpha >= 0.5 else 0


def test_gamma1_follows_the_rate_of_tier0_drafts_and_watches_while_at_none():
    controller = ByRate()
    policy = SpeculationPolicy(spec(gamma1=3), gamma1_controller=controller)
    policy.tier0_checked(0, 0)  # tier 0 had nothing to propose: no word on its rate
    for _ in range(TIER0_EVIDENCE):
        assert policy.next_gamma1() == 3  # too little seen: the planned gamma1
        policy.tier0_checked(3, 0)
    assert controller.seen == []
    picks = [policy.next_gamma1() for _ in range(GAMMA1_PROBE)]
    assert picks == [0] * (GAMMA1_PROBE - 1) + [1]  # none, then a single draft keeps watch
    assert controller.seen[-1] == 0.0
    policy.tier0_checked(1, 1)  # the probe was kept: the next check probes again
    assert policy.next_gamma1() == 1
    policy.tier0_checked(1, 0)  # refused: back to none
    assert policy.next_gamma1() == 0
    for _ in range(8):
        policy.tier0_checked(3, 3)  # text that repeats itself: kept drafts fill the window
    assert policy.next_gamma1() == 3  # the controller's 6, capped at the planned gamma1 (the room)


def test_gamma1_stays_as_planned_without_a_controller():
    policy = SpeculationPolicy(spec(gamma1=3))
    for _ in range(20):
        policy.tier0_checked(3, 0)
    assert policy.next_gamma1() == 3
