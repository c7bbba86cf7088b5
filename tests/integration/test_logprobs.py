"""Log-probabilities of the emitted tokens (triforce.decoding.logprobs): under every method, each
emitted token's logprob and top alternatives are the target's own at that position, what one
plain forward pass over the final sequence gives (float64), greedy and sampled, with penalties
(which do not change the reported distribution), a stop token ending a round early included."""
import pytest
import torch

from triforce.cache.resident import ResidentKVCache
from triforce.config import SamplingParams, SpecParams
from triforce.decoding.engine import Engine
from triforce.decoding.logprobs import LogprobRecorder
from triforce.model.loading import load_model
from test_greedy_equivalence import TINY_PROMPTS, tiny_spec


@pytest.fixture(scope="module")
def pair(tiny_model_dir):
    target = load_model(str(tiny_model_dir("llama-gqa")), dtype="float64", device="cpu")
    draft = load_model(str(tiny_model_dir("llama-gqa", seed=7, num_layers=1, hidden_size=32)), dtype="float64",
                       device="cpu")
    return target, draft


def reference(lm, sequence: list[int]) -> torch.Tensor:
    """log_softmax of one forward pass over `sequence`: row i is the distribution of token i + 1."""
    cache = ResidentKVCache(lm.config, len(sequence), dtype=lm.dtype)
    step = cache.step(len(sequence))
    return torch.log_softmax(lm.model(torch.tensor([sequence]), step.positions, step)[0].double(), -1)


def generate(pair, method, params, stop_ids=frozenset()):
    target, draft = pair
    ids = target.tokenizer(TINY_PROMPTS[0]).input_ids
    spec = SpecParams(method="ar") if method == "ar" else tiny_spec(method)
    engine = Engine(target, spec, len(ids) + 30, draft if spec.uses_draft else None)
    engine.set_sequence(ids)
    recorder = LogprobRecorder(top=5)
    result = engine.generate(30, params, stop_ids=stop_ids, logprobs=recorder)
    return ids, result, recorder.entries


def assert_the_targets_own(target, ids, tokens, entries):
    assert [e.token for e in entries] == tokens and tokens
    rows = reference(target, ids + tokens)[len(ids) - 1:len(ids) - 1 + len(tokens)]
    for entry, row in zip(entries, rows):
        assert abs(entry.logprob - float(row[entry.token])) < 1e-9
        values, top = row.topk(5)
        assert [t for t, _ in entry.top] == top.tolist()
        assert all(abs(v - float(w)) < 1e-9 for (_, v), w in zip(entry.top, values))


@pytest.mark.parametrize("method", ["ar", "triforce", "retrieval", "naive"])
@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.9, seed=3),
                                    SamplingParams(temperature=0.7, seed=5, repeat_penalty=1.4, penalty_last_n=8)],
                         ids=["greedy", "sampled", "penalized"])
def test_each_emitted_tokens_logprob_is_the_targets_own(pair, method, params):
    ids, result, entries = generate(pair, method, params)
    assert len(result.tokens) == 30
    assert_the_targets_own(pair[0], ids, result.tokens, entries)
    if method != "ar":
        assert result.stats["mean_tokens_per_full_verify"] > 1  # rounds of several tokens were recorded


def test_a_stop_token_inside_a_round_keeps_only_the_emitted_tokens_entries(pair, monkeypatch):
    """The full tier's round emitted tokens past the stop token; their entries go with them."""
    cut = []
    real_commit = LogprobRecorder.committed

    def committed(self, plan):
        cut.append(len(self._pending) > plan.emitted)
        real_commit(self, plan)

    monkeypatch.setattr(LogprobRecorder, "committed", committed)
    params = SamplingParams(temperature=0.9, seed=3)
    _, whole, _ = generate(pair, "triforce", params)
    for stop in dict.fromkeys(whole.tokens[3:]):  # each distinct token after the first few
        cut.clear()
        ids, result, entries = generate(pair, "triforce", params, stop_ids=frozenset({stop}))
        assert result.stopped_by == "eos" and result.tokens == whole.tokens[:whole.tokens.index(stop) + 1]
        assert_the_targets_own(pair[0], ids, result.tokens, entries)
        if cut[-1]:
            return
    raise AssertionError("no stop token fell inside a round")
