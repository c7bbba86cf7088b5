"""Issue 71: a seed's draws. Seeds of a request's choices stay in range whatever the seed; a
seeded token is an exact sample drawn from (seed, position) alone (Gumbel-max), checked against
the plain reference: inverse-CDF sampling of the same distribution."""
import pytest
import torch
from scipy.stats import chisquare

from triforce.config import SEED_MAX, SEED_MIN, SamplingParams
from triforce.decoding.numerics import NonFiniteLogits
from triforce.decoding.sampling import PositionNoise, choice_seed
from triforce.decoding.verification import Draws, verify_coupled


@pytest.mark.parametrize("seed", [SEED_MIN, -1, 0, 40, 2**63, SEED_MAX])
def test_every_choice_seed_is_in_range_and_the_first_is_the_seed(seed):
    seeds = [choice_seed(seed, i) for i in range(8)]
    assert seeds[0] == seed and len(set(seeds)) == 8
    for s in seeds:
        SamplingParams(temperature=1.0, seed=s)  # in range: no error
        torch.Generator().manual_seed(s)


def test_position_noise_draws_the_distribution():
    """Token at one position over 20,000 seeds against p (the Gumbel-max trick), and the draws at
    two positions of one seed independent (pairs against p x p)."""
    p = torch.tensor([0.5, 0.25, 0.15, 0.07, 0.03], dtype=torch.float64)
    firsts, pairs = [], []
    for seed in range(20_000):
        noise = PositionNoise(seed)
        a, b = noise.choose(torch.stack([p, p]), 17).tolist()
        firsts.append(a)
        pairs.append(a * 5 + b)
    counts = torch.bincount(torch.tensor(firsts), minlength=5).tolist()
    assert chisquare(counts, (p * len(firsts)).tolist()).pvalue > 0.001
    joint = torch.bincount(torch.tensor(pairs), minlength=25).double()
    assert chisquare(joint.tolist(), (torch.outer(p, p).flatten() * len(pairs)).tolist()).pvalue > 0.001


def test_the_same_seed_and_position_draw_the_same_token_anywhere():
    p = torch.softmax(torch.randn(4, 50, generator=torch.Generator().manual_seed(3), dtype=torch.float64), -1)
    whole = PositionNoise(99).choose(p, 10).tolist()
    one_by_one = [PositionNoise(99).choose(p[i:i + 1], 10 + i).item() for i in range(4)]
    assert whole == one_by_one
    assert PositionNoise(100).choose(p, 10).tolist() != whole or PositionNoise(101).choose(p, 10).tolist() != whole


def test_verify_coupled_keeps_the_drafts_the_target_would_have_chosen():
    p = torch.softmax(torch.randn(4, 50, generator=torch.Generator().manual_seed(5), dtype=torch.float64), -1)
    noise = PositionNoise(7)
    own = noise.choose(p, 30).tolist()
    assert verify_coupled(own[:3], p, noise, 30).accepted == 3 and verify_coupled(own[:3], p, noise, 30).token == own[3]
    wrong = [own[0], (own[1] + 1) % 50, own[2]]
    verdict = verify_coupled(wrong, p, noise, 30)
    assert (verdict.accepted, verdict.token) == (1, own[1])
    with pytest.raises(NonFiniteLogits):
        verify_coupled([], torch.full((1, 50), float("nan"), dtype=torch.float64), noise, 30)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_host_loop_chooses_what_torch_operators_choose_from_the_same_noise(dtype):
    """kernels.cpu.gumbel_max against argmax(log p + g) in torch over the uniforms a card draws
    (the same bits as the loop's): words without mass among them, keys at both ends of 64 bits;
    an inf or NaN anywhere is reported."""
    import numpy as np

    from triforce.decoding.sampling import _uniforms
    from triforce.kernels.cpu import gumbel_max

    g = torch.Generator().manual_seed(4)
    p = torch.softmax(torch.randn(3, 3000, generator=g, dtype=torch.float64) * 3, -1).to(dtype)
    p[0, ::2] = 0
    keys = [0, 2**64 - 1, 12345]
    u = torch.stack([_uniforms(k, 3000, torch.device("cpu")) for k in keys])
    assert u.tolist() == [[gumbel_max.uniform(np.uint64(k), j) for j in range(3000)] for k in keys]
    assert bool(((u > 0) & (u < 1)).all())
    *got, bad = gumbel_max.choices(p, keys)
    assert got == (p.double().log() - torch.log(-torch.log(u))).argmax(-1).tolist() and bad == 0
    assert p[0, got[0]] > 0 and got != gumbel_max.choices(p, [1, 2, 3])[:-1]
    p[2, 9] = float("nan")
    assert gumbel_max.choices(p, keys)[-1] == 1


def test_a_generator_given_keeps_speculative_samplings_test():
    """The chi-square tests of every method pass a generator: they test the unseeded path."""
    params = SamplingParams(temperature=1.0, seed=3)
    assert Draws(params, torch.device("cpu")).noise is not None
    assert Draws(params, torch.device("cpu"), torch.Generator().manual_seed(1)).noise is None
    assert Draws(SamplingParams(temperature=1.0), torch.device("cpu")).noise is None
    assert Draws(SamplingParams(seed=3), torch.device("cpu")).noise is None  # greedy
