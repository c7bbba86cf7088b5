"""The bfloat16 dot-instruction kernel (AVX512-BF16) against float64 and the widening kernel, its
per-row invariance, and which kernel small_rows_linear takes. Skipped where the CPU lacks it."""
import numpy as np
import pytest
import torch

from triforce.kernels.cpu.simd import bf16_dot
from triforce.kernels.cpu.simd.bf16_bits import bits_of
from triforce.kernels.cpu.linear.dense import rows_times_weights
from triforce.kernels.cpu.simd.bf16_dot import HAS_BF16_DOT, PAIR_BLOCK, bf16_rows
from triforce.kernels.cpu.attention.bf16_values import weight_pairs
from triforce.kernels.cpu.simd.f32_lanes import max_of
from triforce.kernels.cpu.linear.dense import SMALL_ROWS, linear_widening, small_rows_linear

needs_instruction = pytest.mark.skipif(not HAS_BF16_DOT, reason="this CPU has no AVX512-BF16")


def _case(rows, width, n=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, width, generator=g).to(torch.bfloat16)
    x = torch.randn(rows, width, generator=g).to(torch.bfloat16)
    return x, w


@needs_instruction
@pytest.mark.parametrize("rows", [1, 3, 4, 7, SMALL_ROWS])
@pytest.mark.parametrize("width", [PAIR_BLOCK, 576])
def test_matches_float64(rows, width):
    x, w = _case(rows, width, seed=rows)
    out = np.zeros((rows, w.shape[0]), np.float32)
    rows_times_weights(bits_of(x), bits_of(w), out)
    ref = (x.double() @ w.double().T).numpy()
    # exact products, float32 sums: the error of a float32 sum of `width` terms
    assert np.abs(out - ref).max() <= 1e-5 * np.abs(x.double()).sum(1).max() * np.abs(w.double()).max()


@needs_instruction
def test_a_row_alone_equals_the_row_among_sixteen():
    """Four rows share a weight load; each must still take its own steps, bit for bit."""
    x, w = _case(SMALL_ROWS, 576, n=33)
    together = np.zeros((SMALL_ROWS, 33), np.float32)
    rows_times_weights(bits_of(x), bits_of(w), together)
    for i in range(SMALL_ROWS):
        alone = np.zeros((1, 33), np.float32)
        rows_times_weights(bits_of(x[i:i + 1].contiguous()), bits_of(w), alone)
        assert np.array_equal(alone[0], together[i]), i


def test_bf16_rows_is_exact_on_bfloat16_values():
    x = torch.randn(5, 64).to(torch.bfloat16)
    x[0, :4] = torch.tensor([0.0, -0.0, float("inf"), -3.0e38])
    assert np.array_equal(bf16_rows(x.float().numpy()), bits_of(x))


@needs_instruction
def test_small_rows_linear_takes_the_instruction_for_bfloat16_widths_in_blocks():
    x, w = _case(3, 128)
    via, pairs, widened = (np.zeros((3, 40), np.float32) for _ in range(3))
    small_rows_linear(x.float().numpy(), bits_of(w), via)
    rows_times_weights(bits_of(x), bits_of(w), pairs)
    linear_widening(x.float().numpy(), bits_of(w), widened)
    assert np.array_equal(via, pairs)
    assert not np.array_equal(via, widened)  # the two really are different summations


def test_other_widths_widen():
    x, w = _case(3, 100)
    via, widened = np.zeros((3, 40), np.float32), np.zeros((3, 40), np.float32)
    small_rows_linear(x.float().numpy(), bits_of(w), via)
    linear_widening(x.float().numpy(), bits_of(w), widened)
    assert np.array_equal(via, widened)


def test_a_portable_numba_target_never_uses_the_instruction(monkeypatch):
    from triforce.kernels.cpu.simd.features import kernels_may_use
    monkeypatch.setattr(bf16_dot.numba.config, "CPU_NAME", "generic")
    assert not kernels_may_use("avx512_bf16")


@needs_instruction
@pytest.mark.parametrize("dim", [32, 64, 128])
def test_scores_match_float64_and_keep_a_keys_bits_in_a_group_or_alone(dim):
    from triforce.kernels.cpu.attention.bf16_scores import scores_bf16_pairs
    g = torch.Generator().manual_seed(dim)
    q = torch.randn(9, dim, generator=g).to(torch.bfloat16)
    k = torch.randn(70, dim, generator=g).to(torch.bfloat16)
    grouped, alone = np.zeros((9, 70), np.float32), np.zeros((9, 70), np.float32)
    scores_bf16_pairs(bits_of(q), bits_of(k), 64, np.float32(0.3), grouped)  # four groups of 16
    ref = (q.double() @ k.double().T).numpy() * 0.3
    assert np.abs(grouped[:, :64] - ref[:, :64]).max() <= 1e-5 * np.abs(ref).max()
    for s in range(64):  # each key as the remainder of a call (the one-by-one path)
        scores_bf16_pairs(bits_of(q), bits_of(k[s:s + 1].contiguous()), 1, np.float32(0.3), alone[:, s:s + 1])
    assert np.array_equal(grouped[:, :64], alone[:, :64])
    single = np.zeros((1, 70), np.float32)
    scores_bf16_pairs(bits_of(q[4:5].contiguous()), bits_of(k), 64, np.float32(0.3), single)
    assert np.array_equal(single[0, :64], grouped[4, :64])


@needs_instruction
@pytest.mark.parametrize("dim", [32, 64, 128])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, 27])
def test_turned_keys_give_the_grouped_kernels_bits_for_any_row_count(dim, rows):
    """Verify passes (many rows) take scores_turned, decoding steps scores_grouped: a token's
    scores must not depend on which, or a verify would score it unlike its own decoding step."""
    from triforce.kernels.cpu.attention.bf16_scores import scores_grouped, scores_turned
    g = torch.Generator().manual_seed(dim + rows)
    q = bits_of((torch.randn(rows, dim, generator=g) * 3).to(torch.bfloat16))
    k = bits_of(torch.randn(48, dim, generator=g).to(torch.bfloat16))
    grouped, turned = np.zeros((rows, 48), np.float32), np.ones((rows, 48), np.float32)
    scores_grouped(q, k, 48, np.float32(0.125), grouped)
    scores_turned(q, k, 48, np.float32(0.125), turned)
    assert np.array_equal(turned, grouped)


def _weighted_values(p, v, n):
    from triforce.kernels.cpu.attention.bf16_values import values_bf16_pairs
    rows, dim = p.shape[0], v.shape[1]
    acc = np.zeros((rows, dim), np.float32)
    values_bf16_pairs(p.numpy(), bits_of(v), n, acc, np.zeros((4, dim), np.uint16),
                      np.zeros((rows, (p.shape[1] + 1) // 2), np.uint32))
    return acc


@needs_instruction
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 27])
@pytest.mark.parametrize("n, dim", [(64, 64), (37, 64), (50, 128)])
def test_weighted_values_match_float64_with_weights_in_bfloat16(rows, n, dim):
    g = torch.Generator().manual_seed(rows * n)
    p = torch.rand(rows, 64, generator=g)
    v = torch.randn(64, dim, generator=g).to(torch.bfloat16)
    acc = _weighted_values(p, v, n)
    ref = (p[:, :n].to(torch.bfloat16).double() @ v[:n].double()).numpy()
    assert np.abs(acc - ref).max() <= 1e-5 * n * np.abs(v.double()).max()


@needs_instruction
def test_weighted_values_of_a_row_do_not_depend_on_the_other_rows_or_hidden_keys():
    """A decoding step sees fewer keys than the verify pass that holds the same token: keys past
    a row's view weigh 0 there, and the row's sums must come out with the same bits."""
    g = torch.Generator().manual_seed(3)
    p = torch.rand(9, 64, generator=g)
    v = torch.randn(64, 64, generator=g).to(torch.bfloat16)
    together = _weighted_values(p, v, 64)
    for r, seen in ((0, 64), (4, 63), (8, 1)):
        row = p[r:r + 1].clone()
        row[:, seen:] = 0
        hidden = _weighted_values(row, v, 64)  # the verify pass: later keys weigh an exact 0
        assert np.array_equal(_weighted_values(row, v, seen), hidden)  # the step: fewer keys
        if seen == 64:
            assert np.array_equal(hidden[0], together[r])


@needs_instruction
@pytest.mark.parametrize("n", [1, 15, 16, 33, 512])
def test_weight_pairs_round_as_torch_does_in_pairs(n):
    """The 16-lane rounding must give torch's bfloat16 bits (ties to even; a NaN stays one) and a zero
    high half past an odd n, as the scalar tail does."""
    g = torch.Generator().manual_seed(n)
    p = torch.rand(3, 512, generator=g)
    p[0, :n:7] = 1.0 + 2.0 ** -8  # halfway between two bfloat16: ties go to the even one, down here
    p[2, :n:5] = 1.0 + 3 * 2.0 ** -8  # and up here
    p[1, n // 2] = float("nan")
    out = np.zeros((3, 256), np.uint32)
    weight_pairs(p.numpy(), n, out)
    expected = bits_of(p.to(torch.bfloat16)).astype(np.uint32)
    expected[1, n // 2] = 0x7FC0  # torch's vector path makes NaN 0xFFFF here: any NaN will do, narrow's is this
    expected[:, n:] = 0
    pairs = (n + 1) // 2
    want = expected[:, 0:2 * pairs:2] | (expected[:, 1:2 * pairs:2] << 16)
    assert np.array_equal(out[:, :pairs], want)


@pytest.mark.parametrize("n", [1, 15, 16, 17, 100, 512])
def test_max_of_is_the_largest_value(n):
    a = torch.randn(n, generator=torch.Generator().manual_seed(n)).numpy()
    a[n // 3] = 7.5  # anywhere: in a 16-lane block or in the tail
    assert max_of(a, n) == a.max() == 7.5
