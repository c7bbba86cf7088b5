"""Adapting gamma2 while generating: the engine feeds the controller the acceptance it observes,
uses its choice, and stays lossless; `profile tune` writes a profile the planner accepts."""
import json

import pytest

from test_cli import run_cli
from triforce.config import SamplingParams, SpecParams
from triforce.decoding.engine import Engine
from triforce.decoding.hooks import EngineHooks
from triforce.model.loading import load_model

PROMPT = "the cat sat on the mat. the cat sat on the hat. the cat and the dog sat on the log. the cat"


class Recorder:
    """A controller that records what it was shown and answers with a fixed rule."""

    def __init__(self, rule):
        self.seen, self.rule = [], rule

    def choose(self, observed):
        self.seen.append(observed)
        return self.rule(observed, len(self.seen))


@pytest.fixture(scope="module")
def lm(tiny_model_dir):
    return load_model(str(tiny_model_dir("llama-gqa", max_position_embeddings=512)), dtype="float64", device="cpu")


def run(lm, spec, controller=None, new_tokens=40):
    ids = lm.tokenizer(PROMPT).input_ids
    engine = Engine(lm, spec, len(ids) + new_tokens, "lookup" if spec.uses_draft else None,
                    hooks=EngineHooks(gamma2_controller=controller))
    engine.set_sequence(ids)
    return engine, engine.generate(new_tokens, SamplingParams())


def test_engine_reports_the_observed_acceptance_and_uses_the_choice(lm):
    exact = Recorder(lambda observed, n: 6 if observed > 0.9 else 2)
    # a retrieval budget larger than the context holds everything: the full tier accepts it all
    engine, _ = run(lm, SpecParams(method="retrieval", budget=512, gamma2=3, gamma2_min=2, gamma2_max=6), exact)
    assert exact.seen and min(exact.seen) == 1.0 and engine.gammas[-1] == 6
    poor = Recorder(lambda observed, n: 6 if observed > 0.9 else 2)
    engine, _ = run(lm, SpecParams(method="streaming", budget=8, chunk_size=2, sink_tokens=2, gamma2=3,
                                   gamma2_min=2, gamma2_max=6), poor)
    assert max(poor.seen) < 0.9 and engine.gammas[-1] == 2


def test_changing_gamma2_every_round_stays_lossless(lm):
    expected = run(lm, SpecParams())[1].tokens
    cycling = Recorder(lambda observed, n: 1 + n % 6)
    spec = SpecParams(method="triforce", budget=24, chunk_size=4, sink_tokens=4, rebuild_stride=8, gamma2=3,
                      gamma2_min=1, gamma2_max=6)
    engine, result = run(lm, spec, cycling)
    assert result.tokens == expected and len(set(cycling.seen)) > 1 and len(cycling.seen) > 3


def test_gamma2_outside_its_bounds_is_refused():
    with pytest.raises(Exception, match="gamma2 bounds"):
        SpecParams(gamma2=9, gamma2_min=2, gamma2_max=8)


def test_profile_tune_writes_a_profile_the_planner_uses(capsys, tmp_path, default_model_dir):
    out = tmp_path / "mine.toml"
    acceptance = tmp_path / "acceptance.json"
    acceptance.write_text(json.dumps({"results": [
        {"policy": "retrieval", "budget": 256, "chunk_size": 8, "greedy_match": 0.9, "expected_accept": 0.92},
        {"policy": "retrieval", "budget": 512, "chunk_size": 8, "greedy_match": 0.9, "expected_accept": 0.95}]}))
    code, stdout, _ = run_cli(capsys, "profile", "tune", "--out", str(out), "--acceptance", str(acceptance))
    assert code == 0 and "wrote" in stdout
    code, stdout, _ = run_cli(capsys, "profile", "show", str(out), "--json")
    shown = json.loads(stdout)
    assert code == 0 and shown["measured"] and shown["hbm_gbps"] > 0 and shown["pcie_h2d_gbps"] > 0
    assert shown["compute_tflops"] > 0 and len(shown["extras"]["acceptance"]) == 2
    formats = {"q8_0", "q4_0", "q4_1", "q4_k", "q6_k"}  # the block kernels' rates, which plan quantized models
    assert set(shown["block_gbps"]) == set(shown["block_tflops"]) == formats
    assert all(v > 0 for v in [*shown["block_gbps"].values(), *shown["block_tflops"].values()])
    code, stdout, _ = run_cli(capsys, "plan", "--model", "default", "--profile", str(out), "--context", "8192",
                              "--json")
    plan = json.loads(stdout)
    assert code == 0 and plan["feasible"]
    assert plan["speculation"]["budget"] in (256, 512) and plan["predictions"]["acceptance"]["measured"]
    lo, hi = plan["speculation"]["gamma2_range"]
    assert lo <= plan["speculation"]["gamma2"] <= hi


def test_bad_acceptance_file_for_tune(capsys, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    code, _, err = run_cli(capsys, "profile", "tune", "--out", str(tmp_path / "x.toml"), "--acceptance", str(bad))
    assert code != 0 and "eval acceptance" in err
