"""Verification math on hand-made distributions."""
import pytest
import torch

from triforce.decoding.tiers import LookupDrafter
from triforce.decoding.verification import verify_greedy, verify_sampled


def test_greedy_accepts_matching_prefix_then_corrects():
    logits = torch.tensor([[0, 5.0, 0], [0, 0, 5.0], [5.0, 0, 0], [0, 5.0, 0]])
    v = verify_greedy([1, 2, 1], logits)
    assert (v.accepted, v.token) == (2, 0)
    v = verify_greedy([1, 2, 0], logits)
    assert (v.accepted, v.token) == (3, 1)  # all accepted: bonus token


def test_sampled_single_step_distribution_is_the_target():
    p = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    q = torch.tensor([0.1, 0.1, 0.8], dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros(3)
    for _ in range(20000):
        draft = int(torch.multinomial(q, 1, generator=g))
        v = verify_sampled([draft], [q], torch.stack([p, p]), g)
        counts[draft if v.accepted else v.token] += 1
    assert torch.allclose(counts / counts.sum(), p.float(), atol=0.015)


def test_deterministic_draft_residual_excludes_the_draft():
    p = torch.tensor([0.0, 1.0, 0.0], dtype=torch.float64)
    v = verify_sampled([0], [None], torch.stack([p, p]), torch.Generator().manual_seed(0))
    assert (v.accepted, v.token) == (0, 1)


def test_lookup_proposes_continuation_of_latest_match():
    drafter = LookupDrafter(max_ngram=3)
    seq = [1, 2, 3, 4, 5, 9, 1, 2, 3, 7, 8, 1, 2, 3]
    assert drafter.propose(seq, 2) == [7, 8]  # the latest earlier "1 2 3" is followed by 7 8
    assert drafter.propose([5, 6, 7], 3) == []
    assert drafter.propose([4, 4, 4, 4], 2) == [4]  # match near the end: shorter proposal


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_greedy_on_host_logits_chooses_as_torch_argmax_does(dtype):
    """The host loop (kernels.cpu.greedy) against torch's argmax path: ties go to the first index,
    a vocabulary-sized row, a strided one, and any inf or NaN raises wherever it is."""
    from triforce.decoding import verification
    from triforce.decoding.numerics import NonFiniteLogits

    g = torch.Generator().manual_seed(3)
    rows = torch.randint(-4, 5, (4, 49152), generator=g).to(dtype)  # many ties at each row's max
    rows[1, 100:] = rows[1, :100].max() - 1  # row 1's max among its first 100
    for logits in (rows, rows[:, ::2]):
        best = torch.argmax(logits, dim=-1).tolist()
        for drafts in ([], best[:2], best[:1] + [best[1] + 1, 0], best[:3]):
            drafts = drafts[:logits.shape[0] - 1]
            ours, reference = verify_greedy(drafts, logits), verification._agreeing(
                drafts, torch.argmax(logits, dim=-1), logits)
            assert (ours.accepted, ours.token) == (reference.accepted, reference.token)
    for bad in (float("inf"), float("-inf"), float("nan")):
        broken = rows.clone()
        broken[3, 7] = bad  # in the last row, past every draft
        with pytest.raises(NonFiniteLogits):
            verify_greedy([], broken)
