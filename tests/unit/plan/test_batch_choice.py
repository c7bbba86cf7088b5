"""The cost model for batches (triforce.plan.batch_choice): MagicDec's trend, the row's share
of the device, and the pick --method auto makes for a batch."""
import json

import pytest

from triforce.cli.main import main
from triforce.config import SpecParams
from triforce.model.architectures import arch_config
from triforce.plan.batch_choice import (BatchPrediction, choose_for_batch, predict_batch, row_profile,
                                        spec_for)
from triforce.plan.method_choice import AUTO_MARGIN
from triforce.plan.profiles import load_profile
from triforce.offload.shapes import weight_bytes

LLAMA3 = arch_config("llama3.1-8b")


def by_method(predictions):
    return {p.method: p for p in predictions}


def test_speculation_gains_more_as_the_batch_grows():
    """MagicDec: the KV of a batch outweighs the weights, so drafting over a small KV pays more."""
    h100 = load_profile("h100-80g")
    gains = []
    for rows in (1, 2, 4):
        p = by_method(predict_batch(LLAMA3, h100, 65536, rows, SpecParams(), dtype_bytes=2))
        assert p["ar"].rows == rows
        gains.append(p["ar"].ms_per_token / p["snapkv"].ms_per_token)
    assert gains[0] < gains[1] < gains[2]
    # MagicDec's ratios: as the batch's KV grows the draft step gets cheaper against a target step
    one, four = (by_method(predict_batch(LLAMA3, h100, 65536, r, SpecParams(), dtype_bytes=2))["snapkv"] for r in (1, 4))
    assert 0 < four.draft_to_target < one.draft_to_target < 1 and one.verify_to_decode >= 1
    one, four = (by_method(predict_batch(LLAMA3, h100, 65536, r, SpecParams(), dtype_bytes=2))["ar"] for r in (1, 4))
    assert four.ms_per_token > one.ms_per_token and four.tokens_per_s > one.tokens_per_s  # latency for throughput


def test_a_row_plans_in_its_share_of_the_device():
    h100 = load_profile("h100-80g")
    weights = weight_bytes(LLAMA3, 2)
    share = row_profile(LLAMA3, h100, 4, 2)
    assert share.device_budget_bytes == weights + (h100.device_budget_bytes - weights) // 4
    assert row_profile(LLAMA3, h100, 1, 2) is h100


def test_sizes_the_user_gave_are_kept():
    predictions = predict_batch(LLAMA3, load_profile("h100-80g"), 32768, 2, SpecParams(budget=512, gamma2=5),
                                dtype_bytes=2, fixed=frozenset({"budget", "gamma2"}))
    assert {(p.budget, p.gamma2) for p in predictions if p.method != "ar"} == {(512, 5)}


def test_auto_takes_speculation_only_with_the_margin():
    ar = BatchPrediction("ar", 4, 10.0)
    close = BatchPrediction("snapkv", 4, 10.0 / AUTO_MARGIN * 1.01, budget=256, gamma2=6)
    far = BatchPrediction("snapkv", 4, 10.0 / AUTO_MARGIN * 0.99, budget=256, gamma2=6)
    assert choose_for_batch([ar, close]).chosen is ar
    assert choose_for_batch([ar, far]).chosen is far
    spec, fixed = spec_for(far, SpecParams(method="auto"), frozenset())
    assert (spec.method, spec.budget, spec.gamma2, spec.gamma2_range) == ("snapkv", 256, 6, (6, 6))
    assert fixed == {"budget", "gamma2", "chunk_size"}
    assert spec_for(ar, SpecParams(method="auto"), frozenset())[1] == frozenset()


def test_plan_shows_the_batch_table(capsys):
    with pytest.raises(SystemExit) as done:
        main(["plan", "--arch", "llama3.1-8b", "--profile", "h100-80g", "--context", "65536", "--batch-size", "4",
              "--method", "auto", "--json"])
    assert done.value.code == 0
    report = json.loads(capsys.readouterr().out)
    methods = {p["method"] for p in report["batch"]["predictions"]}
    assert {"ar", "streaming", "snapkv", "retrieval", "triforce"} <= methods
    assert report["method"] == report["batch"]["method"] != "ar"
    assert report["gpu_budget_bytes"] < load_profile("h100-80g").device_budget_bytes  # one row's share
    with pytest.raises(SystemExit):
        main(["plan", "--arch", "llama3.1-8b", "--context", "1024", "--batch-size", "0"])
    assert "--batch-size must be >= 1" in capsys.readouterr().err
