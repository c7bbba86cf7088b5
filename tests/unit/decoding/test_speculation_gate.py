"""--method auto's online check without a model: ar steps calibrate the reference, speculative
rounds are scored per token against it, ar takes over while they lose, a probe follows a hold
that doubles while probes lose, and speculation comes back when probes win. Round costs are
given (as tests do) rather than read from a clock, so decisions repeat exactly."""
from triforce.decoding.speculation_gate import (CALIBRATION_STEPS, GATE_HOLD, GATE_WINDOW, PROBE_GAMMA, PROBE_SHARE,
                                                SpeculationGate)

AR_MS = 10.0
GAMMA2 = 8  # the drafts the engine asks for


def given_ms(passes, seconds, length):
    """The test says each round's cost in `seconds` (as milliseconds)."""
    return seconds


def calibrated(gate, length=100, ms=AR_MS):
    for i in range(CALIBRATION_STEPS):
        assert not gate.speculate(length + i)
        gate.round_done(length + i, [("full", 1)], 1, speculated=False, seconds=ms)
    return length + CALIBRATION_STEPS


def spec_round(gate, length, emitted, ms, gamma2=GAMMA2):
    """A speculative round as the engine runs one: it asks the gate for the drafts first."""
    asked = gate.gamma(gamma2)
    gate.round_done(length, [("lookup", 0), ("full", asked + 1)], emitted, speculated=True, seconds=ms)
    return asked


def winning_probes(gate, length, ms=1.2 * AR_MS):
    """Probes that each bring back all their drafts, until one of full drafts has won."""
    while gate.probing:
        assert gate.speculate(length)
        length += spec_round(gate, length, emitted=gate.gamma(GAMMA2) + 1, ms=ms) + 1
    return length


def test_ar_steps_calibrate_before_the_first_speculative_round():
    gate = SpeculationGate(cost=given_ms)
    length = calibrated(gate)
    assert gate.speculate(length) and gate.ar_ms(length) == AR_MS


def test_rounds_that_pay_keep_speculating():
    gate = SpeculationGate(cost=given_ms)
    length = calibrated(gate)
    for _ in range(20):
        spec_round(gate, length, emitted=5, ms=19.0)  # 3.8 ms a token against 10
        length += 5
        assert gate.speculate(length)
    assert gate.fallbacks == 0


def test_losing_rounds_hand_over_to_ar_then_probe_with_a_doubling_hold():
    gate = SpeculationGate(cost=given_ms)
    length = calibrated(gate)
    for _ in range(GATE_WINDOW - 1):
        spec_round(gate, length, emitted=1, ms=19.0)
        length += 1
        assert gate.speculate(length)  # the window is not full yet
    spec_round(gate, length, emitted=1, ms=19.0)
    assert gate.fallbacks == 1
    assert not gate.speculate(length + GATE_HOLD[0] - 1) and gate.speculate(length + GATE_HOLD[0])
    length += GATE_HOLD[0]
    spec_round(gate, length, emitted=1, ms=19.0)  # a losing probe decides alone: the hold doubles
    assert gate.fallbacks == 2
    assert not gate.speculate(length + 2 * GATE_HOLD[0] - 1) and gate.speculate(length + 2 * GATE_HOLD[0])
    length = winning_probes(gate, length + 2 * GATE_HOLD[0])  # speculation comes back
    assert gate.speculate(length) and gate.gamma(GAMMA2) == GAMMA2
    for _ in range(GATE_WINDOW):
        spec_round(gate, length, emitted=1, ms=19.0)
        length += 1
    assert gate.fallbacks == 3  # ... and the next loss waits the first hold again
    assert not gate.speculate(length - 1 + GATE_HOLD[0] - 1) and gate.speculate(length - 1 + GATE_HOLD[0])


def test_a_costly_losing_probe_waits_until_its_cost_is_a_small_share():
    """26K on a CPU, sampled (issue 60): a probe took 11 ar steps' time for its one token and the
    next came 16 tokens later; 64-token answers ran at 0.81x ar. The next probe now waits until the
    10 steps it lost are PROBE_SHARE of the hold, then the hold doubles from there."""
    gate = SpeculationGate(cost=given_ms, ar_first=32)
    length = calibrated(gate)
    while not gate.speculate(length):
        length += 1
    assert gate.gamma(GAMMA2) == PROBE_GAMMA  # a probe checks few drafts: it is likelier to lose
    spec_round(gate, length, emitted=1, ms=11 * AR_MS)
    hold = round(10 / PROBE_SHARE)
    assert gate.fallbacks == 1 and hold > GATE_HOLD[0]
    assert not gate.speculate(length + hold - 1) and gate.speculate(length + hold)
    spec_round(gate, length + hold, emitted=1, ms=11 * AR_MS)
    assert not gate.speculate(length + 3 * hold - 1) and gate.speculate(length + 3 * hold)
    length += 3 * hold
    asked = []
    while gate.probing:  # winning probes, each checking twice the drafts of the last up to all 12
        assert gate.speculate(length)
        asked.append(gate.gamma(12))
        spec_round(gate, length, emitted=asked[-1] + 1, ms=2 * AR_MS, gamma2=12)
        length += asked[-1] + 1
    assert asked == [PROBE_GAMMA, 2 * PROBE_GAMMA, 4 * PROBE_GAMMA, 8 * PROBE_GAMMA, 12] and PROBE_GAMMA == 1
    assert gate.speculate(length) and gate.gamma(12) == 12


def test_one_lucky_probe_does_not_bring_back_full_drafts():
    """Prose at 26K, sampled (Xeon): a probe's drafts happened to pass, speculation came back
    at gamma2 8, and four 9-token verifies lost before the window said so (0.82x ar). Probes are
    scored together after each one, each drafting twice the last, until one of full drafts wins."""
    gate = SpeculationGate(cost=given_ms, ar_first=32)
    length = calibrated(gate)
    while not gate.speculate(length):
        length += 1
    assert gate.gamma(GAMMA2) == PROBE_GAMMA
    spec_round(gate, length, emitted=PROBE_GAMMA + 1, ms=1.5 * AR_MS)  # lucky: 2 tokens for 1.5 steps
    length += PROBE_GAMMA + 1
    assert gate.speculate(length) and gate.gamma(GAMMA2) == 2 * PROBE_GAMMA and gate.fallbacks == 0
    spec_round(gate, length, emitted=1, ms=2 * AR_MS)  # the next finds nothing: 3.5 steps for 3 tokens
    assert gate.fallbacks == 1 and not gate.speculate(length + 1)


def test_a_probe_that_stops_short_keeps_its_drafts_for_the_next():
    """26K seeded (Zen 3): a probe of one draft passed, the next of two stopped at its first, and
    the score (still winning) brought a probe of four: 406 ms for 2 tokens beside 115 ms steps.
    Only a probe whose drafts all passed doubles the next; while the score wins, the others keep."""
    gate = SpeculationGate(cost=given_ms, ar_first=32)
    length = calibrated(gate)
    while not gate.speculate(length):
        length += 1
    length += spec_round(gate, length, emitted=2, ms=1.2 * AR_MS) + 1  # its draft passed
    assert gate.gamma(GAMMA2) == 2
    spec_round(gate, length, emitted=2, ms=1.4 * AR_MS)  # one of two passed: 5 tokens for 2.6 steps
    length += 2
    assert gate.probing and gate.speculate(length) and gate.gamma(GAMMA2) == 2 and gate.fallbacks == 0
    length += spec_round(gate, length, emitted=3, ms=1.4 * AR_MS) + 1  # both passed: the next checks four
    assert gate.speculate(length) and gate.gamma(GAMMA2) == 4
    spec_round(gate, length, emitted=1, ms=5 * AR_MS)  # none passed, five steps: the score loses
    assert gate.fallbacks == 1 and not gate.speculate(length + 1)


def test_the_hold_stops_doubling_at_its_cap():
    gate = SpeculationGate(cost=given_ms)
    length = calibrated(gate)
    for _ in range(GATE_WINDOW):
        spec_round(gate, length, emitted=1, ms=19.0)
    for _ in range(12):  # every probe loses
        while not gate.speculate(length):
            length += 1
        spec_round(gate, length, emitted=1, ms=19.0)
    wait = 0
    while not gate.speculate(length + wait):
        wait += 1
    assert wait == GATE_HOLD[1]


def test_the_ar_reference_follows_the_length_by_the_cost_model_ratio():
    class Prices:
        def ar_ms(self, length):
            return length / 100  # an ar step's cost grows with the KV read

    gate = SpeculationGate(Prices(), cost=given_ms)
    calibrated(gate, length=1000, ms=20.0)
    assert 39.0 < gate.ar_ms(2000) < 41.0  # measured ~20 ms at ~1000 tokens, twice the KV later


def test_below_the_switch_over_it_is_always_ar_and_no_fallback_is_counted():
    gate = SpeculationGate(speculate_from=500, cost=given_ms)
    calibrated(gate, length=300)
    assert not gate.speculate(499) and gate.speculate(500)
    assert gate.ar_tokens == 0  # below the switch-over ar is the plan, not a fallback


def test_round_prices_are_the_cost_model_s_pass_times_at_the_length():
    from triforce.plan.cost_model import (Hardware, RoundPrices, StepCosts, costs_at, full_verify_ms, tier0_ms,
                                          tier1_ms)

    costs = StepCosts(num_layers=30, weights_bytes=270_000_000, resident_kv_bytes=50_000_000,
                      host_kv_bytes=150_000_000, retrieval_kv_bytes=6_000_000, draft_bytes=20_000_000, draft_layers=4,
                      flops_per_token=2.7e8, draft_flops_per_token=2e7, attention_flops_per_key=30_000, context=8192,
                      budget=1024)
    hw = Hardware(hbm_gbps=30, h2d_gbps=20, compute_tflops=0.1, layer_overhead_us=50, attention_tflops=0.2)
    prices = RoundPrices(costs, hw, resident_tokens=2048)
    at_6k = costs_at(costs, 2048, 6000)
    assert prices.pass_ms("full", 9, 6000) == full_verify_ms(at_6k, hw, 9)
    assert prices.ar_ms(6000) == full_verify_ms(at_6k, hw, 1) < prices.ar_ms(8000)  # longer: more KV to read
    assert prices.pass_ms("sparse", 5, 6000) == tier1_ms(costs, hw, 5)
    assert prices.pass_ms("draft", 3, 6000) == 3 * tier0_ms(costs, hw)
    assert prices.pass_ms("lookup", 7, 6000) == 0.0


def test_ar_first_tries_speculation_once_after_the_hold_and_keeps_it_where_it_pays():
    gate = SpeculationGate(cost=given_ms, ar_first=32)
    calibrated(gate)  # ar steps, which also start the hold at the first length seen
    assert not gate.speculate(100 + 31) and gate.speculate(100 + 32)
    spec_round(gate, 132, emitted=2, ms=12.0)  # a probe of one draft wins: the next checks two
    assert gate.probing and gate.speculate(134) and gate.gamma(GAMMA2) == 2
    length = winning_probes(gate, 134)  # ... until one of all the drafts wins: speculation stays
    assert gate.speculate(length) and not gate.probing and gate.fallbacks == 0
    other = SpeculationGate(cost=given_ms, ar_first=32)
    calibrated(other)
    spec_round(other, 132, emitted=1, ms=19.0)  # the probe loses alone: ar for a hold
    assert other.fallbacks == 1 and not other.speculate(133) and other.speculate(132 + GATE_HOLD[0])


def test_a_requests_first_token_comes_from_an_ar_step_where_that_is_under_half_a_round():
    """A CPU's round (drafting, a verify of gamma + 1 tokens) takes several ar steps: the first
    token of a follow-up comes sooner by a step. An offloaded GPU's round costs about one step
    (the full pass dominates both): there the round stays, or every later token would wait."""
    cpu = SpeculationGate(cost=given_ms)
    length = calibrated(cpu)
    for _ in range(GATE_WINDOW):
        spec_round(cpu, length, emitted=6, ms=30.0)  # 5 ms a token against 10: speculation pays
        length += 6
    assert cpu.speculate(length) and not cpu.speculate(length, first=True)
    assert cpu.speculate(length + 1)  # from the second round on, the rounds again
    gpu = SpeculationGate(cost=given_ms)
    length = calibrated(gpu)
    for _ in range(GATE_WINDOW):
        spec_round(gpu, length, emitted=6, ms=12.0)  # a round barely more than a step
        length += 6
    assert gpu.speculate(length, first=True)
    assert SpeculationGate(cost=given_ms).speculate(100, first=True) is False  # nothing measured: calibrating
