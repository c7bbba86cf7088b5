"""The drafting tiers' fixed-shape runner (the path CUDA graphs capture) against the eager cache
views: the same logits and cache contents step by step, and the same tokens and acceptance
through the whole engine. On CPU the fixed-shape path runs without capture ("static")."""
import pytest
import torch

from triforce.config import SamplingParams, SpecParams
from triforce.decoding.engine import Engine
from triforce.decoding.graph_runner import TierRunner, runner_mode
from triforce.errors import UserError
from triforce.model.loading import load_model

GREEDY = SamplingParams()
PROMPT = "the cat sat on the mat. the cat sat on the hat. the cat sat on the mat. the cat"


@pytest.fixture(scope="module")
def pair(tiny_model_dir):
    target = load_model(str(tiny_model_dir("llama-gqa")), dtype="float64", device="cpu")
    draft = load_model(str(tiny_model_dir("llama-gqa", seed=7, num_layers=1, hidden_size=32)),
                       dtype="float64", device="cpu")
    return target, draft


def spec(**kw):
    return SpecParams(**{**dict(method="triforce", gamma1=3, gamma2=5, budget=24, chunk_size=4, sink_tokens=4,
                                rebuild_stride=8, draft_window=16), **kw})


def run(lm, draft, graphs, method="triforce", new_tokens=40, sampling=GREEDY):
    ids = lm.tokenizer(PROMPT).input_ids
    engine = Engine(lm, spec(method=method), len(ids) + new_tokens, draft, graphs=graphs)
    engine.set_sequence(ids)
    result = engine.generate(new_tokens, sampling, generator=torch.Generator().manual_seed(3))
    return result.tokens, engine.rounds, engine


@pytest.mark.parametrize("drafter", ["model", "lookup"])
def test_static_runner_gives_the_same_tokens_and_checks_as_eager(pair, drafter):
    target, draft_model = pair
    draft = draft_model if drafter == "model" else "lookup"
    ar, _, _ = run(target, None, "off", method="ar")
    eager_tokens, eager_rounds, _ = run(target, draft, "off")
    static_tokens, static_rounds, engine = run(target, draft, "static")
    assert static_tokens == eager_tokens == ar
    assert static_rounds == eager_rounds  # float64: the same drafts accepted at every tier
    runners = [t.runner for t in engine.levels if t.runner is not None]
    assert runners and all(r.mode == "static" for r in runners)
    assert all(r.static_runs > r.eager_runs for r in runners)  # most steps took the fixed-shape path


@pytest.mark.parametrize("method", ["ar", "triforce"])
def test_the_full_tier_runs_its_short_passes_at_a_fixed_shape(pair, method):
    """Issue 73: the full tier's decoding steps and verifies take the fixed-shape path the graphs
    capture (its queries recorded there for the retrieval tier); its prefill stays eager."""
    target, draft_model = pair
    eager = run(target, draft_model, "off", method=method)
    static = run(target, draft_model, "static", method=method)
    assert static[0] == eager[0] and static[1] == eager[1]
    full = static[2].full.runner
    assert full is not None and full.static_runs > 0 and full.eager_runs == 0
    assert eager[2].full.runner is None


def test_the_full_tier_stays_eager_where_its_shape_cannot_be_fixed(tiny_model_dir):
    from triforce.cache.offloaded import OffloadedKVCache

    windowed = load_model(str(tiny_model_dir("gemma3")), dtype="float64", device="cpu")
    assert Engine(windowed, spec(method="ar"), 64, graphs="static").full.runner is None
    target = load_model(str(tiny_model_dir("llama-gqa")), dtype="float64", device="cpu")
    offloaded = OffloadedKVCache(target.config, 64, 16, 8, dtype=torch.float64, device="cpu", pin=False)
    assert Engine(target, spec(method="ar"), 64, kv_cache=offloaded, graphs="static").full.runner is None


def test_static_runner_sampling_matches_eager(pair):
    target, draft_model = pair
    sampling = SamplingParams(temperature=0.8, seed=11)
    eager = run(target, draft_model, "off", sampling=sampling)
    static = run(target, draft_model, "static", sampling=sampling)
    assert static[0] == eager[0] and static[1] == eager[1]


def test_static_step_matches_eager_step_on_a_sparse_cache(pair):
    """One tier step at a time: logits and every cache slot agree."""
    target, _ = pair
    ids = target.tokenizer(PROMPT).input_ids
    engines = [Engine(target, spec(method="retrieval"), len(ids) + 20, graphs=g) for g in ("off", "static")]
    for engine in engines:
        engine.set_sequence(ids)
    tiers = [e.levels[0] for e in engines]
    seq = ids + [5, 9, 2, 7]
    for upto in (len(ids) + 1, len(ids) + 4, len(ids) + 5):
        outs = [t.logits(seq[:upto]) for t in tiers]
        torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=1e-10)
        end = tiers[0].cache.end
        assert torch.allclose(tiers[0].cache.k_buf[:, :, :, :end], tiers[1].cache.k_buf[:, :, :, :end], atol=1e-12)
        seq.append(3)


def test_runner_modes_and_errors():
    assert runner_mode("auto", torch.device("cpu")) == "eager"
    assert runner_mode("off", torch.device("cpu")) == "eager"
    assert runner_mode("static", torch.device("cpu")) == "static"
    with pytest.raises(UserError, match="unknown graphs setting"):
        runner_mode("sometimes", torch.device("cpu"))

    class Cache:
        k_buf = torch.zeros(1, 1, 1, 4, 2)
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        TierRunner(None, Cache(), "graph")
    with pytest.raises(ValueError, match="unknown runner mode"):
        TierRunner(None, Cache(), "fast")


def test_steps_longer_than_the_graph_limit_run_eagerly(pair):
    target, draft = pair
    ids = target.tokenizer(PROMPT).input_ids
    engine = Engine(target, spec(), len(ids) + 30, draft, graphs="static")
    for tier in engine.levels[:-1]:
        tier.runner.max_graph_tokens = 2
    engine.set_sequence(ids)
    tokens = engine.generate(30, GREEDY).tokens
    assert tokens == run(target, None, "off", method="ar", new_tokens=30)[0]
    assert all(t.runner.eager_runs > 0 for t in engine.levels[:-1])
