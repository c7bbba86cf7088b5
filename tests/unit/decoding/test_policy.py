"""The speculation policy's decisions, without a model: rebuilds when stale or struggling, the
rolling window, and gamma2 following its controller."""
from triforce.config import SpecParams
from triforce.decoding.policy import ROLLING_ROUNDS, SpeculationPolicy


def spec(**kw):
    return SpecParams(method="triforce", rebuild_stride=100, rebuild_threshold=0.5, gamma2=4, **kw)


def test_a_stale_cache_is_rebuilt_whatever_the_acceptance():
    policy = SpeculationPolicy(spec())
    assert not policy.should_rebuild(99)
    assert policy.should_rebuild(100)
    policy.full_verified(4, 4)
    assert policy.should_rebuild(100) and not policy.should_rebuild(20)


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
