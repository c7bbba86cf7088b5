"""--method auto end to end: the default of generate and chat, the choice printed and in --json,
and the engine's switch from ar-style steps to speculation at the chosen length (same tokens)."""
import json

import pytest
import torch

from triforce.config import SamplingParams, SpecParams
from triforce.decoding.engine import Engine

from test_cli import run_cli


def _ids(lm):
    text = "The history of the printing press begins in the fifteenth century, when"
    return lm.tokenizer(text, add_special_tokens=False).input_ids


def test_engine_decodes_as_ar_until_the_switch_then_speculates(default_lm):
    ids = _ids(default_lm)
    ar = Engine(default_lm, SpecParams(method="ar"), len(ids) + 40)
    ar.set_sequence(ids)
    expected = ar.generate(40, SamplingParams()).tokens
    switch = len(ids) + 15
    spec = SpecParams(method="retrieval", budget=24, chunk_size=4, gamma2=4)
    engine = Engine(default_lm, spec, len(ids) + 40, speculate_from=switch)
    engine.set_sequence(ids)
    assert engine.generate(40, SamplingParams()).tokens == expected
    emitted, before, after = len(ids), [], []
    for tier, proposed, accepted in engine.rounds:
        if tier == "full":
            (before if emitted < switch else after).append(proposed)
            emitted += accepted + 1
    assert before and set(before) == {0}   # one token per full-cache pass, as ar
    assert after and max(after) > 0        # then drafts from the retrieval tier


def test_an_engine_needs_a_method_not_auto(default_lm):
    with pytest.raises(ValueError, match="auto"):
        Engine(default_lm, SpecParams(method="auto"), 64)


def test_generate_defaults_to_auto_and_says_what_it_chose(capsys, default_model_dir):
    code, out, err = run_cli(capsys, "generate", "--model", "default", "--prompt", "The capital of France is",
                             "--max-new-tokens", "4", "--temperature", "0", "--dtype", "bfloat16")
    # a short context on a CPU in bfloat16 (what auto picks there, and what the cpu profile was
    # measured in): speculation does not pay
    assert code == 0 and "method auto: ar" in err
    code, out, _ = run_cli(capsys, "generate", "--model", "default", "--prompt", "The capital of France is",
                           "--max-new-tokens", "4", "--temperature", "0", "--json", "--dtype", "bfloat16")
    result = json.loads(out)
    assert code == 0 and result["method"] == "ar" and result["method_choice"]["method"] == "ar"
    assert set(result["method_choice"]["predicted_ms_per_token"]) == {"ar", "triforce", "retrieval", "naive"}
    code, out, _ = run_cli(capsys, "generate", "--model", "default", "--prompt", "The capital of France is",
                           "--max-new-tokens", "4", "--temperature", "0", "--json", "--method", "ar")
    assert json.loads(out)["method_choice"] is None


def test_plan_shows_the_choice(capsys):
    code, out, _ = run_cli(capsys, "plan", "--arch", "llama2-7b-128k", "--profile", "rtx4090-24g",
                           "--context", "130048", "--method", "auto", "--dtype", "bfloat16")
    assert code == 0 and "method auto: triforce" in out and "ar below" in out
    code, out, _ = run_cli(capsys, "plan", "--arch", "llama2-7b-128k", "--profile", "rtx4090-24g",
                           "--context", "130048", "--method", "auto", "--dtype", "bfloat16", "--json")
    plan = json.loads(out)
    assert plan["method"] == "triforce" and plan["method_choice"]["speculate_from"] > 0


class VerifyHeavyPrices:
    """A full pass costs 10 ms plus 2 ms per extra token; lookup drafts cost nothing."""

    def pass_ms(self, kind, tokens, length):
        return 10.0 + 2.0 * (tokens - 1) if kind == "full" else 0.0

    def ar_ms(self, length):
        return 10.0


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_low_acceptance_falls_back_to_ar_with_the_same_tokens(tiny_model_dir, temperature, monkeypatch):
    """A random model rejects what prompt lookup drafts from a repeating prompt: the online check
    finds speculation slower, decodes as ar, probes again later, and the tokens are ar's."""
    from triforce.decoding.hooks import EngineHooks
    from triforce.decoding import speculation_gate
    from triforce.decoding.speculation_gate import GATE_HOLD, SpeculationGate
    from triforce.model.loading import load_model

    lm = load_model(str(tiny_model_dir("llama-gqa", max_position_embeddings=512, seed=1)), dtype="float64",
                    device="cpu")
    ids = lm.tokenizer("abc abd abe abf abg abh " * 4).input_ids
    params = SamplingParams(temperature=temperature, seed=5)
    ar = Engine(lm, SpecParams(method="ar"), len(ids) + 120)
    ar.set_sequence(ids)
    expected = ar.generate(120, params).tokens
    prices = VerifyHeavyPrices()
    priced = lambda passes, seconds, length: sum(prices.pass_ms(k, n, length) for k, n in passes)  # noqa: E731
    gate = SpeculationGate(prices, cost=priced)  # priced, not timed: the test repeats exactly
    monkeypatch.setattr(speculation_gate, "PROBE_GAMMA", 1)
    decided, speculate = [], gate.speculate  # (speculates, as a probe) of each round
    monkeypatch.setattr(gate, "speculate", lambda *a: decided.append((speculate(*a), gate.probing)) or decided[-1][0])
    engine = Engine(lm, SpecParams(method="naive", gamma2=8), len(ids) + 120, "lookup",
                    hooks=EngineHooks(speculation_gate=gate))
    engine.set_sequence(ids)
    result = engine.generate(120, params)
    if temperature == 0:
        assert result.tokens == expected
    assert result.stats["auto_fallbacks"] == gate.fallbacks >= 1
    assert result.stats["auto_ar_tokens"] == gate.ar_tokens >= GATE_HOLD[0]
    checked = [proposed for tier, proposed, _ in engine.rounds if tier == "full"]
    assert checked.count(0) >= gate.ar_tokens  # one token per ar pass (and rounds lookup had nothing for)
    rounds = list(zip(decided, checked))  # a probe after ar steps checks at most PROBE_GAMMA drafts (1 here)
    firsts = [n for ((go, probe), n), ((went, _), _) in zip(rounds[1:], rounds) if go and probe and not went]
    others = [n for (go, probe), n in rounds if not probe]
    assert firsts and max(firsts) <= 1 and (temperature or max(others) > 1)


class DraftHeavyPrices(VerifyHeavyPrices):
    """A pass over a sparse tier costs as much as an ar step: self-speculation loses."""

    def pass_ms(self, kind, tokens, length):
        return super().pass_ms(kind, tokens, length) if kind == "full" else 10.0


def test_ar_steps_leave_the_sparse_tiers_until_speculation_resumes(tiny_model_dir):
    """While the online check decodes as ar, the sparse tier is neither fed nor rebuilt (a low
    acceptance asked for a rebuild every few ar steps); it catches up before the next speculative
    round, and the tokens stay ar's."""
    from triforce.decoding.hooks import EngineHooks
    from triforce.decoding.speculation_gate import SpeculationGate
    from triforce.model.loading import load_model

    lm = load_model(str(tiny_model_dir("llama-gqa", max_position_embeddings=512, seed=1)), dtype="float64",
                    device="cpu")
    ids = lm.tokenizer("the tide came in over the flats while the gulls argued " * 6).input_ids
    ar = Engine(lm, SpecParams(method="ar"), len(ids) + 160)
    ar.set_sequence(ids)
    expected = ar.generate(160, SamplingParams()).tokens
    prices = DraftHeavyPrices()
    priced = lambda passes, seconds, length: sum(prices.pass_ms(k, n, length) for k, n in passes)  # noqa: E731
    gate = SpeculationGate(prices, cost=priced)
    spec = SpecParams(method="snapkv", budget=48, gamma2=4, rebuild_threshold=1.0, snapkv_window=8)
    engine = Engine(lm, spec, len(ids) + 160, hooks=EngineHooks(speculation_gate=gate))
    engine.set_sequence(ids)
    tier = engine.upkeep.tiers[0]
    rebuilt_while_ar = []
    decide = gate.speculate

    firsts = []

    def speculate(length, first=False):
        firsts.append(first)
        before = tier.rebuilds
        verdict = decide(length, first)
        if not verdict:  # the previous round's upkeep ran already; this one's runs after the pass
            engine.upkeep.after_full_verify = watch(engine.upkeep.after_full_verify, before)
        return verdict

    def watch(call, before):
        def once(*args, **kwargs):
            engine.upkeep.after_full_verify = call
            call(*args, **kwargs)
            rebuilt_while_ar.append(tier.rebuilds - before)
        return once

    gate.speculate = speculate
    result = engine.generate(160, SamplingParams())
    assert result.tokens == expected
    assert gate.fallbacks >= 1 and gate.ar_tokens >= 32 and len(rebuilt_while_ar) == gate.ar_tokens
    assert not any(rebuilt_while_ar)
    assert firsts[0] and not any(firsts[1:])  # only the answer's first round asks for its first token


@pytest.mark.parametrize("method", ["ar", "retrieval", "snapkv"])
def test_the_prefill_count_is_known_before_the_prefill(tiny_model_dir, method):
    """The server's streamed progress says `reused + done / total`: tokens_to_prefill must be what
    set_sequence prefills, also where a selection re-runs its window of cached tokens (it once
    printed 56/49 on a request that extended a cached conversation)."""
    from triforce.model.loading import load_model

    lm = load_model(str(tiny_model_dir("llama-gqa", max_position_embeddings=512)), dtype="float32", device="cpu")
    spec = SpecParams(method=method, budget=40, chunk_size=4) if method != "ar" else SpecParams(method="ar")
    engine = Engine(lm, spec, 400)
    first = lm.tokenizer("the cat sat on the mat. " * 4).input_ids
    for ids in (first, first + lm.tokenizer(" and the dog sat too.").input_ids, first[:30]):
        expected = engine.tokens_to_prefill(ids)
        counted = []
        assert engine.set_sequence(ids, counted.append) == expected == sum(counted)
        assert expected <= len(ids) - 1


@pytest.mark.parametrize("own_generator", [False, True])
def test_a_seeded_sample_repeats_whatever_the_clock_says(own_generator, tiny_model_dir, monkeypatch):
    """A seed's draws depend on the position alone: two runs whose clocks disagree (the check
    falls back to ar at different rounds, timing them) give the same answer. With a generator of
    its own beside the seed the draws follow the rounds: the check prices them instead, so the
    rounds, and the answer, repeat. Unseeded (and greedy) runs keep timing them."""
    import triforce.decoding.engine as engine_module
    from triforce.decoding.hooks import EngineHooks
    from triforce.decoding.speculation_gate import SpeculationGate, wall_ms
    from triforce.model.loading import load_model

    lm = load_model(str(tiny_model_dir("llama-gqa", max_position_embeddings=512, seed=1)), dtype="float64",
                    device="cpu")
    ids = lm.tokenizer("abc abd abe abf abg abh " * 4).input_ids
    answers, gates = [], []
    for tick in (0.0, 1.0):  # a clock that stands still (speculation never loses), one that races
        now = [0.0]

        def clock():  # a speculative round reads it more often than an ar step
            now[0] += tick
            return now[0]

        monkeypatch.setattr(engine_module.time, "perf_counter", clock)
        gate = SpeculationGate(VerifyHeavyPrices())
        engine = Engine(lm, SpecParams(method="naive", gamma2=4), len(ids) + 80, "lookup",
                        hooks=EngineHooks(speculation_gate=gate))
        engine.set_sequence(ids)
        generator = torch.Generator().manual_seed(3) if own_generator else None
        answers.append(engine.generate(80, SamplingParams(temperature=0.9, seed=11), generator=generator).tokens)
        assert (gate.cost is wall_ms) != own_generator
        gates.append(gate.fallbacks)
        engine.set_sequence(ids)
        engine.generate(4, SamplingParams(temperature=0.9))
        assert gate.cost is wall_ms  # unseeded: timed again
    assert answers[0] == answers[1]
    assert (gates[0] == gates[1]) == own_generator  # timed, the racing clock made the check fall back
