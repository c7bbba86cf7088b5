"""The softmax's 16-lane exp (triforce.kernels.cpu.simd.f32_lanes.exp_sum) against float64, what it
writes past the visible scores, and its sum."""
import numpy as np
import pytest

from triforce.kernels.cpu.simd.exp import exp_in_place
from triforce.kernels.cpu.simd.f32_lanes import exp_sum, max_of

WIDTH = 512  # a split of the attention kernel


def _scores(seed):
    return (np.random.default_rng(seed).standard_normal(WIDTH) * 12).astype(np.float32)


@pytest.mark.parametrize("seen", [1, 15, 16, 17, 300, WIDTH])
def test_exponentials_match_float64_and_zeros_follow(seen):
    a = _scores(seen)
    top = max_of(a, seen)
    differences = a[:seen] - top  # what the kernel exponentiates (float32, as it rounds them)
    got = a.copy()
    got[seen:] = np.nan  # past `seen`: never trusted, whatever lies there
    total = exp_sum(got, seen, top)
    want = np.exp(differences.astype(np.float64))
    assert np.all(np.abs(got[:seen] - want) <= 2e-7 * want + 1e-38)
    assert np.all(got[seen:] == 0.0)
    assert abs(total - want.sum()) <= 1e-6 * want.sum()


def test_within_an_ulp_of_exp_in_place_and_clamped_as_it():
    """The same method as cpu_exp's loops (Cephes), fused multiply-adds aside, and the same floor."""
    d = np.concatenate([np.linspace(-90.0, 0.0, WIDTH - 4), [-87.0, -1e-8, -200.0, 0.0]]).astype(np.float32)
    got = d.copy()
    exp_sum(got, WIDTH, np.float32(0.0))
    ref = d.copy()
    exp_in_place(ref, WIDTH, np.empty(WIDTH, np.int32))
    assert np.all(np.abs(got - ref) <= np.spacing(ref))
    assert got[-2] == got[-4] == ref[-2] > 0  # below -87: exp(-87), never 0 or a subnormal


def test_the_sum_is_the_same_whatever_is_hidden_past_seen():
    """A row's sum depends on the values it keeps only: what lies past `seen` adds exact zeros."""
    a = _scores(1)
    b = a.copy()
    b[200:] = _scores(2)[200:] * 3  # other scores past the visible 200
    top = max_of(a, 200)
    assert exp_sum(a.copy(), 200, top) == exp_sum(b.copy(), 200, top)
