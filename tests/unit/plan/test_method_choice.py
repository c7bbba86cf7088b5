"""--method auto: the cost model's pick of a method and of the length from which speculation pays."""
import pytest

from triforce.config import SpecParams
from triforce.errors import UserError
from triforce.model.architectures import arch_config
from triforce.plan.cost_model import Acceptance
from triforce.plan.method_choice import AUTO_MARGIN, choose_method, lengths
from triforce.plan.profiles import load_profile

AUTO = SpecParams(method="auto")


def test_lengths_grow_to_the_context():
    assert lengths(8192) == [256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192]
    assert lengths(100) == [100]


def test_a_short_context_on_the_cpu_decodes_as_ar():
    choice, spec = choose_method(arch_config("smollm2-135m"), load_profile("cpu"), 600, AUTO, frozenset(),
                                 dtype_bytes=2)
    assert choice.method == "ar" and spec.method == (choice.probe or "ar") and choice.speculate_from == 0
    assert set(choice.predicted_ms) == {"ar", "triforce", "retrieval", "naive"}
    assert "method auto: ar" in choice.describe() and f"{AUTO_MARGIN}x" in choice.describe()


def test_an_offloaded_long_context_speculates_from_where_it_pays():
    """Llama2-7B-128K on a 24 GB card at 128K with prompt-lookup drafts: the KV crosses PCIe at
    every full verify, the regime TriForce targets; while the sequence is short, ar is as good."""
    model, profile = arch_config("llama2-7b-128k"), load_profile("rtx4090-24g")
    choice, spec = choose_method(model, profile, 130048, AUTO, frozenset(), dtype_bytes=2)
    assert choice.method == spec.method == "triforce" and choice.speedup >= AUTO_MARGIN
    assert 0 < choice.speculate_from < 130048
    ar, triforce = choice.predicted_ms["ar"], choice.predicted_ms["triforce"]
    assert ar / triforce == pytest.approx(choice.speedup)
    assert choice.to_json()["speculate_from"] == choice.speculate_from
    assert f"ar below {choice.speculate_from} tokens" in choice.describe()


def test_without_a_tier_0_only_retrieval_is_weighed():
    choice, _ = choose_method(arch_config("smollm2-135m"), load_profile("cpu"), 600, AUTO, frozenset(),
                              dtype_bytes=4, has_tier0=False)
    assert set(choice.predicted_ms) == {"ar", "retrieval"}


def test_flags_the_user_gave_stay():
    spec = SpecParams(method="auto", budget=2048, gamma2=6)
    choice, chosen = choose_method(arch_config("llama2-7b-128k"), load_profile("rtx4090-24g"), 130048, spec,
                                   frozenset({"budget", "gamma2"}), dtype_bytes=2, assumed=Acceptance(0.9, 0.8))
    assert chosen.method != "ar" and chosen.budget == 2048 and chosen.gamma2 == 6


def test_auto_is_a_method_name_until_planned():
    assert SpecParams(method="auto").uses_draft  # the draft is loaded: auto may pick triforce
    with pytest.raises(UserError, match="auto"):
        SpecParams(method="automatic")


def tier_row(draft, temperature, full_rate, retrieval_kept):
    return {"draft": draft, "temperature": temperature, "budget": 1024, "gamma1": 4, "gamma2": 8,
            "acceptance_rates": {"retrieval": retrieval_kept, "full": 0.5},
            "per_token_rates": {"retrieval": 0.5, "full": full_rate}}


def test_measured_tier_acceptance_takes_the_lowest_lookup_rows():
    from triforce.plan.speculation_choice import measured_tier_acceptance

    rows = [tier_row("lookup", 0.0, 0.93, 0.53), tier_row("lookup", 0.6, 0.91, 0.16), tier_row("none", 0.0, 0.5, 0.1),
            {"policy": "retrieval", "budget": 1024, "expected_accept": 0.9}]
    assert measured_tier_acceptance(rows) == Acceptance(full=0.91, retrieval=0.16, measured=True)
    assert measured_tier_acceptance(rows[3:]) is None


def test_auto_predicts_with_the_profile_s_measured_tier_acceptance():
    """A profile that measured poor lookup acceptance makes auto's prediction for triforce slower
    than the built-in assumption does (and says it was measured)."""
    from dataclasses import replace

    model, profile = arch_config("llama2-7b-128k"), load_profile("rtx4090-24g")
    assumed, _ = choose_method(model, profile, 130048, AUTO, frozenset(), dtype_bytes=2)
    poor = replace(profile, extras=(*profile.extras, ("acceptance", [tier_row("lookup", 0.6, 0.6, 0.05)])))
    measured, _ = choose_method(model, poor, 130048, AUTO, frozenset(), dtype_bytes=2)
    assert measured.predicted_ms["triforce"] > assumed.predicted_ms["triforce"]
    assert measured.predicted_ms["ar"] == assumed.predicted_ms["ar"]


def test_where_ar_is_picked_but_repeating_text_would_pay_speculation_is_tried():
    """On the CPU at 8K tokens the model expects ar to win at natural text's acceptance, but
    lookup drafts checked by the full cache (naive) would pay on text that repeats: ar runs, with
    naive's tiers built to be tried now and then. A profile where nothing could pay tries nothing."""
    from dataclasses import replace as with_rates

    from triforce.plan.method_choice import BEST_CASE

    choice, spec = choose_method(arch_config("smollm2-135m"), load_profile("cpu"), 8192, AUTO, frozenset(),
                                 dtype_bytes=4)
    assert choice.method == "ar" and choice.probe == spec.method == "naive"
    assert "trying naive now and then" in choice.describe() and choice.to_json()["probe"] == "naive"
    best, _ = choose_method(arch_config("smollm2-135m"), load_profile("cpu"), 8192, AUTO, frozenset(), dtype_bytes=4,
                            assumed=BEST_CASE)
    assert best.method == "naive"  # the probe is the method that wins when the drafts are kept
    # arithmetic so slow that a pass of n tokens costs n steps: drafts cannot pay even when all are kept
    slow = with_rates(load_profile("cpu"), compute_tflops=1e-5, attention_tflops=1e-5)
    nothing, spec = choose_method(arch_config("smollm2-135m"), slow, 8192, AUTO, frozenset(), dtype_bytes=4)
    assert nothing.probe is None and spec.method == "ar"
