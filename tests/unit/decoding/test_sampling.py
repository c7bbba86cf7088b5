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


def _penalized_by_hand(logits: list[float], context: list[int], params: SamplingParams) -> list[float]:
    """llama.cpp's penalties, one token at a time."""
    window = context[-params.penalty_last_n:]
    out = []
    for token, logit in enumerate(logits):
        count = window.count(token)
        if count:
            logit = logit / params.repeat_penalty if logit > 0 else logit * params.repeat_penalty
            logit -= count * params.frequency_penalty + params.presence_penalty
        out.append(logit)
    return out


def test_each_row_is_penalized_by_its_own_context():
    from triforce.decoding.sampling import penalize

    params = SamplingParams(temperature=1.0, repeat_penalty=1.5, presence_penalty=0.25, frequency_penalty=0.5,
                            penalty_last_n=4)
    seq = [0, 1, 1, 2, 3, 1, 4, 2]  # a verify of 3 drafts: its 4 rows follow seq[:5] to seq[:8]
    rows = torch.tensor([[1.0, -2.0, 0.5, 3.0, -0.5, 2.0]] * 4, dtype=torch.float64)
    got = penalize(rows, seq, params)
    for j in range(4):
        context = seq[:len(seq) - 3 + j]
        assert got[j].tolist() == pytest.approx(_penalized_by_hand(rows[j].tolist(), context, params)), j
    assert penalize(rows, seq, SamplingParams(temperature=1.0)) is rows  # no penalty: nothing done


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_host_penalties_in_a_loop_give_what_torch_operators_give(dtype, monkeypatch):
    """kernels.cpu.penalties against torch's operators on a verify's rows over a 49152-word
    vocabulary: windows with repeats, a window shorter than the rest, positive, negative, zero
    and -inf logits; the same bits (one rounding per operator either way)."""
    from triforce.decoding import sampling

    g = torch.Generator().manual_seed(2)
    rows = (torch.randn(4, 49152, generator=g) * 4).to(dtype)
    seq = [int(t) for t in torch.randint(0, 200, (70,), generator=g)] + [5, 5, 5, 7]
    rows[:, 5], rows[:, 7], rows[1, seq[40]] = 0.0, float("-inf"), -3.0
    params = SamplingParams(temperature=1.0, repeat_penalty=1.3, presence_penalty=0.25, frequency_penalty=0.5)
    calls, loop = [], sampling.penalties.penalized
    monkeypatch.setattr(sampling.penalties, "penalized", lambda *a: calls.append(1) or loop(*a))
    for context in (seq, seq[:5]):  # full windows; then windows of 2 to 5 tokens
        got = sampling.penalize(rows, context, params)
        with monkeypatch.context() as patched:
            patched.setattr(sampling.penalties, "takes", lambda calc: False)
            want = sampling.penalize(rows, context, params)
        assert got.dtype == want.dtype and torch.equal(got, want)
        assert not torch.equal(got, rows.to(got.dtype))
    assert len(calls) == 2


def test_penalties_out_of_range_are_refused():
    for bad in (dict(repeat_penalty=0), dict(presence_penalty=2.5), dict(frequency_penalty=-3),
                dict(penalty_last_n=0)):
        with pytest.raises(UserError):
            SamplingParams(**bad)


@pytest.mark.parametrize("temperature", [0.2, 0.7, 5.0])
def test_top_p_from_candidates_keeps_what_sorting_the_vocabulary_keeps(temperature, monkeypatch):
    """A CPU's nucleus from its most likely candidates, when it lies among them, against the
    vocabulary sorted; a wider one takes the sort itself."""
    from triforce.decoding import sampling

    g = torch.Generator().manual_seed(int(temperature * 10))
    logits = torch.randn(5, 49152, generator=g) * 4
    params = SamplingParams(temperature=temperature, top_p=0.9)
    with monkeypatch.context() as patched:
        patched.setattr(sampling, "NUCLEUS_CANDIDATES", 1 << 20)  # more than the vocabulary: always sorted
        patched.setattr(sampling.distribution, "takes", lambda *a: False)  # and torch's operators, not the loop
        sorted_ = probabilities(logits, params)
    sorts, real_sort = [], torch.sort
    monkeypatch.setattr(torch, "sort", lambda *a, **k: sorts.append(1) or real_sort(*a, **k))
    fast = probabilities(logits, params)
    widest = int((sorted_ > 0).sum(-1).max())
    assert bool(sorts) == (widest >= sampling.NUCLEUS_CANDIDATES) and (temperature != 0.2 or not sorts)
    assert torch.equal(fast > 0, sorted_ > 0)
    torch.testing.assert_close(fast, sorted_, rtol=1e-6, atol=1e-7)


def _torch_operators(logits, params, monkeypatch):
    from triforce.decoding import sampling

    with monkeypatch.context() as patched:
        patched.setattr(sampling.distribution, "takes", lambda *a: False)
        return probabilities(logits, params)


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.2, 0, 0.9), (1.0, 0, 1.0), (0.7, 5, 1.0), (1.0, 40, 0.5),
                                                     (5.0, 0, 0.95), (1.0, 1, 0.9), (0.7, 64, 0.99)])
def test_the_host_loop_gives_the_distribution_torch_operators_give(temperature, top_k, top_p, monkeypatch):
    """kernels.cpu.distribution (float32 host logits) against torch's operators in float64: the
    same words kept, the same probabilities within a few float32 roundings (torch's float32
    softmax is off by 2e-5 here); rows with ties at the top and -inf logits among them; wide
    nuclei (temperature 5) through the sorting path, row by row."""
    from triforce.decoding import sampling

    g = torch.Generator().manual_seed(top_k * 7 + int(temperature * 10))
    logits = torch.randn(5, 49152, generator=g) * 4
    logits[1, [3, 70, 9000]] = logits[1].max() + 1  # three words tied first
    logits[2, ::3] = float("-inf")
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    calls, loop = [], sampling.distribution.distributions
    monkeypatch.setattr(sampling.distribution, "distributions", lambda *a: calls.append(1) or loop(*a))
    got = probabilities(logits, params)
    want = _torch_operators(logits.double(), params, monkeypatch)
    if top_k or top_p < 1:
        assert torch.equal(got > 0, want > 0)
    else:  # unfiltered: below exp's floor (~1.6e-38 a word) the loop's weights are zero
        assert bool((want[got > 0] > 0).all()) and bool((got[want > 1e-36] > 0).all())
    assert calls
    torch.testing.assert_close(got, want.float(), rtol=5e-6, atol=1e-12)
    assert torch.equal(probabilities(logits[3], params), got[3])  # a [V] row as the same row of a batch
    if top_k:
        assert int((got > 0).sum(-1).max()) <= top_k + 2  # the three tied words are the only ties


def test_each_row_of_the_host_loop_is_its_own(monkeypatch):
    """A verify's rows come out as each row would alone: a flat row (a nucleus wider than the
    loop's candidates) beside peaked ones changes none of them."""
    g = torch.Generator().manual_seed(3)
    flat, peaked = torch.randn(1, 49152, generator=g) * 0.01, torch.randn(2, 49152, generator=g) * 8
    params = SamplingParams(temperature=0.7, top_p=0.9)
    batch = torch.cat([peaked[:1], flat, peaked[1:]])
    together = probabilities(batch, params)
    alone = [probabilities(row, params) for row in batch]
    assert all(torch.equal(together[i], alone[i]) for i in range(3))
    assert int((together[1] > 0).sum()) > 64 and int((together[0] > 0).sum()) < 64
    torch.testing.assert_close(together, _torch_operators(batch.double(), params, monkeypatch).float(),
                               rtol=5e-6, atol=1e-12)


@pytest.mark.parametrize("broken", [float("nan"), float("inf")])
def test_the_host_loop_passes_a_broken_row_on_as_torch_does(broken):
    from triforce.decoding.numerics import NonFiniteLogits
    from triforce.decoding.sampling import sample

    logits = torch.randn(2, 49152, generator=torch.Generator().manual_seed(1))
    logits[1, 17] = broken
    probs = probabilities(logits, SamplingParams(temperature=0.7, top_p=0.9))
    assert bool(probs[0].isfinite().all()) and bool(probs[1].isnan().all())
    with pytest.raises(NonFiniteLogits):
        sample(probs[1], torch.Generator().manual_seed(0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_host_draw_follows_its_distribution_and_never_draws_a_word_without_mass(dtype):
    """sample's loop over cumulative sums (kernels.cpu.draw) against the probabilities, words of
    probability zero among them; the edge of [0, 1) lands on the last word with mass."""
    import numpy as np
    from scipy.stats import chisquare

    from triforce.decoding.sampling import sample
    from triforce.kernels.cpu.draw import draw

    p = torch.tensor([0.0, 0.1, 0.0, 0.25, 0.05, 0.6, 0.0], dtype=dtype) * 3  # unnormalised, as multinomial takes
    g = torch.Generator().manual_seed(5)
    drawn = torch.tensor([sample(p, g) for _ in range(20000)])
    counts = torch.bincount(drawn, minlength=len(p))
    assert counts[p == 0].sum() == 0
    kept = p > 0
    assert chisquare(counts[kept].tolist(), (p[kept] / p.sum() * len(drawn)).tolist()).pvalue > 0.001
    assert draw(p.numpy(), np.nextafter(1.0, 0.0)) == 5 and draw(p.numpy(), 0.0) == 1


def test_a_host_draw_refuses_what_multinomial_refuses():
    from triforce.decoding.numerics import NonFiniteLogits
    from triforce.decoding.sampling import sample

    g = torch.Generator().manual_seed(0)
    for broken in ([0.5, float("nan")], [0.5, float("inf")], [0.5, -0.1]):
        with pytest.raises(NonFiniteLogits):
            sample(torch.tensor(broken), g)
    with pytest.raises(RuntimeError, match="sum of probabilities <= 0"):
        sample(torch.zeros(3), g)
