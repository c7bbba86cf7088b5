"""The engine's round (triforce.decoding.engine): generate loops over step, which plans a round,
runs the checks and commits what the full tier kept; the optional parts hear each round as
observers (decoding.observers). Exactness of every method against ar is
tests/integration/test_greedy_equivalence.py; here, what the loop itself promises."""
import pytest

from triforce.config import SamplingParams, SpecParams
from triforce.decoding.engine import Engine
from triforce.decoding.observers import Observer
from triforce.model.loading import load_model

GREEDY = SamplingParams()
SPEC = SpecParams(method="triforce", gamma1=3, gamma2=5, budget=24, chunk_size=4, sink_tokens=4, rebuild_stride=8,
                  draft_window=16)
PROMPT = [5, 9, 12, 7, 5, 9, 12, 7, 5, 9, 12, 7, 3, 8, 14, 2, 5, 9, 12, 7, 3, 8] * 3


@pytest.fixture(scope="module")
def lm(tiny_model_dir):
    return load_model(str(tiny_model_dir("llama-gqa")), dtype="float64", device="cpu")


def engine_over(lm, spec=SPEC, new_tokens=24, ids=PROMPT) -> Engine:
    engine = Engine(lm, spec, len(ids) + new_tokens, "lookup" if spec.uses_draft else None)
    engine.set_sequence(ids)
    return engine


class Recorder(Observer):
    """Every call, in order; optionally keeps the full tier from speculating."""

    def __init__(self, speculate: bool = True):
        self.calls, self.plans, self.speculate = [], [], speculate

    def started(self, params):
        self.calls.append("started")

    def planning(self, plan):
        self.calls.append("planning")
        plan.speculate = plan.speculate and self.speculate

    def full_logits(self, logits, tokens):
        self.calls.append("full_logits")

    def committed(self, plan):
        self.calls.append("committed")
        self.plans.append(plan)

    def report(self):
        return {"recorder_rounds": len(self.plans)}


def test_an_observer_hears_each_round_in_order_and_reports(lm):
    engine, seen = engine_over(lm), Recorder()
    engine.observers.append(seen)
    result = engine.generate(20, GREEDY)
    rounds = len(seen.plans)
    assert seen.calls[0] == "started" and seen.calls.count("started") == 1
    assert seen.calls[1:] == ["planning", "full_logits", "committed"] * rounds
    assert sum(p.emitted for p in seen.plans) == len(result.tokens) == 20
    assert [p.base for p in seen.plans] == [len(PROMPT) + sum(p.emitted for p in seen.plans[:i]) for i in range(rounds)]
    assert seen.plans[0].first and not any(p.first for p in seen.plans[1:])
    assert all(p.seconds > 0 for p in seen.plans)
    assert result.stats["recorder_rounds"] == rounds == result.stats["full_verifies"]
    assert any(p.emitted > 1 for p in seen.plans)  # it speculated: some round kept drafts


def test_a_plan_that_turns_speculation_off_decodes_as_ar(lm):
    ar = engine_over(lm, SpecParams(method="ar")).generate(20, GREEDY)
    engine, held = engine_over(lm), Recorder(speculate=False)
    engine.observers.append(held)
    result = engine.generate(20, GREEDY)
    assert result.tokens == ar.tokens
    assert all(p.emitted == 1 and not p.drafted for p in held.plans) and len(held.plans) == 20
    assert result.stats["proposed"]["full"] == 0


def test_step_cuts_a_round_at_a_stop_token_and_every_cache_with_it(lm):
    free = engine_over(lm).generate(20, GREEDY).tokens
    stop = free[7]
    first = free.index(stop)  # the stop token's first place
    engine = engine_over(lm)
    result = engine.generate(20, GREEDY, frozenset({stop}))
    assert result.tokens == free[:first + 1] and result.stopped_by == "eos"
    assert engine.seq == PROMPT + free[:first + 1]
    assert all(t.covered() <= len(engine.seq) - 1 for t in engine.levels)
    assert engine.stats[-1].emitted == first + 1
    assert engine.generate(5, GREEDY).tokens == free[first + 1:first + 6]  # decoding goes on from there


def test_stop_requested_is_asked_before_each_round(lm):
    asked = []

    def stop_after_three() -> bool:
        asked.append(True)
        return len(asked) > 3

    engine = engine_over(lm)
    result = engine.generate(20, GREEDY, stop_requested=stop_after_three)
    assert result.stopped_by == "interrupt" and len(asked) == 4
    assert result.stats["full_verifies"] == 3 and engine.seq == PROMPT + result.tokens


def test_ctrl_c_in_the_token_callback_keeps_what_was_emitted(lm):
    free = engine_over(lm).generate(20, GREEDY).tokens
    shown = []

    def show(token: int) -> None:
        shown.append(token)
        if len(shown) == 9:
            raise KeyboardInterrupt

    engine = engine_over(lm)
    result = engine.generate(20, GREEDY, on_token=show)
    assert result.stopped_by == "interrupt" and result.tokens == free[:len(result.tokens)]
    assert engine.seq == PROMPT + result.tokens  # the round it was emitting is kept whole
    assert all(t.covered() <= len(engine.seq) - 1 for t in engine.levels)
    assert engine.generate(4, GREEDY).tokens == free[len(result.tokens):len(result.tokens) + 4]


def test_the_summary_is_the_engines_own(lm):
    engine = engine_over(lm)
    result = engine.generate(16, GREEDY)
    assert result.stats["tiers"] == engine.describe() == "lookup -> retrieval -> full"
    assert result.stats["full_verifies"] == engine.stats[-1].rounds
    assert "auto_fallbacks" not in result.stats and "host_syncs" not in result.stats  # no gate, no counter


def test_a_gamma1_controller_that_picks_none_leaves_the_retrieval_tier_drafting_alone(lm):
    """Where checking tier 0's drafts does not pay, the retrieval tier takes none of them but a
    single one now and then (policy.GAMMA1_PROBE), and the tokens stay ar's."""
    from triforce.decoding.hooks import EngineHooks
    from triforce.decoding.policy import TIER0_EVIDENCE

    class NonePays:
        def choose(self, alpha):
            return 0

    ar = engine_over(lm, SpecParams(method="ar"), new_tokens=40).generate(40, GREEDY)
    engine = Engine(lm, SPEC, len(PROMPT) + 40, "lookup", hooks=EngineHooks(gamma1_controller=NonePays()))
    engine.set_sequence(PROMPT)
    checked = []
    engine.policy.tier0_checked = lambda proposed, accepted, record=engine.policy.tier0_checked: (
        checked.append(proposed), record(proposed, accepted))
    result = engine.generate(40, GREEDY)
    assert result.tokens == ar.tokens
    seen, start = 0, 0
    while seen < TIER0_EVIDENCE:  # the planned gamma1 until enough drafts have spoken
        seen, start = seen + (checked[start] > 0), start + 1
    assert max(checked[:start]) == SPEC.gamma1
    assert checked[start + 1:] and max(checked[start + 1:]) == 1 and 0 in checked[start + 1:]
