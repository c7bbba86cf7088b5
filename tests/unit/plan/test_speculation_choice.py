"""The cost model's choice of budget, chunk size and gammas, from measured acceptance rows."""

from triforce.config import SpecParams
from triforce.model.architectures import arch_config
from triforce.plan.profiles import load_profile
from triforce.plan.speculation_choice import choose_speculation, measured_acceptance, plan_with_choice

MODEL = arch_config("llama2-7b-128k")
PROFILE = load_profile("rtx4090-24g")
ROWS = [
    {"policy": "retrieval", "budget": 256, "chunk_size": 8, "expected_accept": 0.50},
    {"policy": "retrieval", "budget": 1024, "chunk_size": 8, "expected_accept": 0.90},
    {"policy": "retrieval", "budget": 4096, "chunk_size": 8, "expected_accept": 0.97},
    {"policy": "streaming", "budget": 4096, "chunk_size": 8, "expected_accept": 0.60},
]


def choose(spec=SpecParams(method="triforce"), fixed=frozenset(), rows=ROWS, context=130048, **kw):
    return choose_speculation(MODEL, PROFILE, context, spec, dtype_bytes=2, fixed=fixed, rows=rows,
                              has_tier0=True, **kw)


def test_rows_by_policy():
    assert measured_acceptance(ROWS, "retrieval") == {(256, 8): 0.5, (1024, 8): 0.9, (4096, 8): 0.97}
    assert measured_acceptance(ROWS, "streaming") == {(4096, 8): 0.6}


def test_offloaded_long_context_prefers_the_budget_that_accepts_most():
    choice = choose()
    assert choice.budget == 4096 and choice.acceptance.measured and choice.acceptance.full == 0.97
    assert choice.gamma2_min <= choice.gamma2 <= choice.gamma2_max


def test_flags_the_user_gave_are_kept():
    choice = choose(SpecParams(method="triforce", budget=256, gamma2=3), fixed=frozenset({"budget", "gamma2"}))
    assert choice.budget == 256 and choice.gamma2 == 3 and choice.gamma2_min == choice.gamma2_max == 3


def test_without_measurements_the_budget_stays_and_acceptance_is_assumed():
    choice = choose(rows=[])
    assert choice.budget == SpecParams().budget and not choice.acceptance.measured


def test_streaming_uses_its_own_rows():
    assert choose(SpecParams(method="streaming")).acceptance.full == 0.6


def test_nothing_fits_gives_none_and_the_plan_says_why():
    small = PROFILE.with_device_budget(4 * 2**30)
    assert choose_speculation(MODEL, small, 130048, SpecParams(method="triforce"), dtype_bytes=2, rows=ROWS) is None
    plan, spec, choice = plan_with_choice(MODEL, small, 130048, SpecParams(method="triforce"), frozenset(),
                                          dtype_bytes=2)
    assert choice is None and not plan.feasible and spec.budget == SpecParams().budget


def test_ar_chooses_nothing():
    plan, spec, choice = plan_with_choice(MODEL, PROFILE, 130048, SpecParams(method="ar"), frozenset(), dtype_bytes=2)
    assert choice is None and plan.feasible


def test_gamma1_adapts_while_decoding_unless_the_user_named_it():
    """`--gamma1 N` is kept as given; left open, the engine lowers it while tier 0's drafts are
    mostly refused (plan.cost_model.Gamma1Controller), where there are tier-0 drafts to check."""
    import torch

    from triforce.app.plan_and_cache import plan_run
    from triforce.plan.cost_model import Gamma1Controller

    def run(spec, fixed=frozenset()):
        return plan_run(arch_config("smollm2-135m"), load_profile("cpu"), 8192, spec, fixed, torch.float32,
                        has_tier0=True)

    assert isinstance(run(SpecParams(method="triforce")).gamma1_controller(True), Gamma1Controller)
    assert run(SpecParams(method="triforce", gamma1=2), frozenset({"gamma1"})).gamma1_controller(True) is None
    assert run(SpecParams(method="triforce")).gamma1_controller(False) is None  # two tiers: no tier-0 drafts
    assert run(SpecParams(method="retrieval")).gamma1_controller(True) is None
