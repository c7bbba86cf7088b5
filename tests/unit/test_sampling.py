import pytest
import torch

from triforce.config import SamplingParams
from triforce.decoding.sampling import make_generator, next_token, probabilities
from triforce.errors import UserError


def test_greedy_is_argmax():
    logits = torch.tensor([0.1, 3.0, 2.9, -1.0])
    assert next_token(logits, SamplingParams(), make_generator(SamplingParams(seed=0))) == 1


def test_temperature_scales_logits():
    logits = torch.tensor([1.0, 2.0, 3.0])
    probs = probabilities(logits, SamplingParams(temperature=0.5))
    assert torch.allclose(probs, torch.softmax(logits / 0.5, -1))


def test_top_k_keeps_k_largest():
    logits = torch.tensor([1.0, 4.0, 3.0, 2.0])
    probs = probabilities(logits, SamplingParams(temperature=1.0, top_k=2))
    expected = torch.softmax(torch.tensor([4.0, 3.0]), -1)
    assert torch.allclose(probs[[1, 2]], expected) and probs[0] == 0 and probs[3] == 0


def test_top_p_keeps_smallest_set_reaching_mass():
    probs_in = torch.tensor([0.5, 0.3, 0.15, 0.05])
    probs = probabilities(probs_in.log(), SamplingParams(temperature=1.0, top_p=0.7))
    # 0.5 alone is < 0.7, 0.5 + 0.3 >= 0.7: keep two tokens
    assert torch.allclose(probs, torch.tensor([0.625, 0.375, 0.0, 0.0]))


def test_top_p_always_keeps_the_top_token():
    probs = probabilities(torch.tensor([5.0, 0.0, 0.0]), SamplingParams(temperature=1.0, top_p=0.01))
    assert probs.tolist() == [1.0, 0.0, 0.0]


def test_seed_reproducible_and_matches_distribution():
    params = SamplingParams(temperature=1.0, seed=123)
    logits = torch.tensor([0.0, 1.0, 2.0])
    draws = lambda: [next_token(logits, params, g) for g in [make_generator(params)] for _ in range(4000)]
    first, second = draws(), draws()
    assert first == second
    freq = torch.bincount(torch.tensor(first), minlength=3).float() / len(first)
    assert torch.allclose(freq, torch.softmax(logits, -1), atol=0.03)


@pytest.mark.parametrize("kwargs", [dict(temperature=-0.1), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-1)])
def test_invalid_sampling_params_rejected(kwargs):
    with pytest.raises(UserError):
        SamplingParams(**kwargs)
