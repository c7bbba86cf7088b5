"""The float32 FMA kernels (triforce.kernels.cpu.simd.f32_dot, f32_attention_parts) against float64 and the
widening kernels, their per-row invariance, bfloat16 bits widened as loaded, and where they are
taken. Skipped where the CPU has no FMA/AVX2 (numba then never compiles them)."""
import numpy as np
import pytest

from triforce.kernels.cpu.simd import f32_dot
from triforce.kernels.cpu.linear.dense import SMALL_ROWS, linear_widening, small_rows_linear
from triforce.kernels.cpu.linear.dense import rows_times_weights
from triforce.kernels.cpu.simd.f32_dot import HAS_F32_FMA, STEP

needs_fma = pytest.mark.skipif(not HAS_F32_FMA, reason="this CPU has no FMA/AVX2")


def _rand(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _sum_bound(x, w):
    """The error allowed a float32 sum of products: 1e-5 of the largest sum of magnitudes."""
    return 1e-5 * (np.abs(x.astype(np.float64)) @ np.abs(w.astype(np.float64)).T).max()


@needs_fma
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 9, SMALL_ROWS])
@pytest.mark.parametrize("width", [STEP, 576])
def test_linear_matches_float64_and_a_row_is_the_same_alone(rows, width):
    x, w = _rand(rows, width, seed=rows), _rand(37, width, seed=width)
    out = np.zeros((rows, 37), np.float32)
    rows_times_weights(x, w, out)
    assert np.abs(out - x.astype(np.float64) @ w.astype(np.float64).T).max() <= _sum_bound(x, w)
    for i in range(rows):  # in a group of four, or in the remainder: the same bits as alone
        alone = np.zeros((1, 37), np.float32)
        rows_times_weights(x[i:i + 1].copy(), w, alone)
        assert np.array_equal(alone[0], out[i]), i


@needs_fma
def test_small_rows_linear_takes_it_for_float32_widths_of_whole_steps():
    x, w = _rand(3, 128), _rand(40, 128, seed=1)
    via, fma, widened = (np.zeros((3, 40), np.float32) for _ in range(3))
    small_rows_linear(x, w, via)
    rows_times_weights(x, w, fma)
    linear_widening(x, w, widened)
    assert np.array_equal(via, fma)
    assert not np.array_equal(fma, widened)  # the two really are different summations
    odd_x, odd_w = _rand(3, 100), _rand(40, 100, seed=1)  # not whole steps: widened
    small_rows_linear(odd_x, odd_w, via)
    linear_widening(odd_x, odd_w, widened)
    assert np.array_equal(via, widened)


def test_a_portable_numba_target_never_uses_fma(monkeypatch):
    from triforce.kernels.cpu.simd.features import kernels_may_use
    monkeypatch.setattr(f32_dot.numba.config, "CPU_NAME", "generic")
    assert not kernels_may_use("fma", "avx2")


@needs_fma
@pytest.mark.parametrize("dim", [64, 128])
def test_scores_and_values_match_float64_and_keep_a_rows_bits_among_others(dim):
    from triforce.kernels.cpu.attention.f32_parts import scores_f32_fma, values_f32_fma
    rows, n = 27, 203  # keys: three blocks and a remainder not a multiple of four
    q, k, v = _rand(rows, dim, seed=1), _rand(n + 5, dim, seed=2), _rand(n + 5, dim, seed=3)
    scores = np.zeros((rows, 256), np.float32)
    scores_f32_fma(q, k, n, scores)
    assert np.abs(scores[:, :n] - q.astype(np.float64) @ k[:n].astype(np.float64).T).max() <= _sum_bound(q, k)
    p = np.abs(_rand(rows, 256, seed=4))
    p[:, n:] = np.nan  # past n: never read
    p[5, 100:n] = 0.0  # keys a row may not see weigh an exact 0
    acc = np.zeros((rows, dim), np.float32)
    values_f32_fma(p, v, n, acc)
    ref = p[:, :n].astype(np.float64) @ v[:n].astype(np.float64)
    assert np.abs(acc - ref).max() <= 1e-5 * (np.abs(p[:, :n]) @ np.abs(v[:n])).max()
    seen = np.zeros((1, dim), np.float32)
    values_f32_fma(p[5:6].copy(), v, 100, seen)  # the row alone, over only the keys it sees
    assert np.array_equal(seen[0], acc[5])
    for r in (0, 5, rows - 1):  # alone, and as the odd last row of a call
        one, one_acc = np.zeros((1, 256), np.float32), np.zeros((1, dim), np.float32)
        scores_f32_fma(q[r:r + 1].copy(), k, n, one)
        values_f32_fma(p[r:r + 1].copy(), v, n, one_acc)
        assert np.array_equal(one[0, :n], scores[r, :n]) and np.array_equal(one_acc[0], acc[r]), r


def _bf16(*shape, seed=0):
    """bfloat16 values: their bits (uint16) and the float32 copy (widening is exact)."""
    import torch
    t = torch.from_numpy(_rand(*shape, seed=seed)).to(torch.bfloat16)
    return t.view(torch.uint16).numpy().copy(), t.to(torch.float32).numpy()


@needs_fma
@pytest.mark.parametrize("rows", [1, 5])
def test_bfloat16_weights_give_the_bits_of_their_float32_copy(rows):
    from triforce.kernels.cpu.simd.bf16_dot import HAS_BF16_DOT
    wb, w32 = _bf16(37, 576, seed=5)
    x = _bf16(rows, 576, seed=rows)[1]
    by_bits, by_copy, via = (np.zeros((rows, 37), np.float32) for _ in range(3))
    rows_times_weights(x, wb, by_bits)
    rows_times_weights(x, w32, by_copy)
    assert np.array_equal(by_bits, by_copy)
    if not HAS_BF16_DOT:  # then bfloat16 weights take this kernel
        small_rows_linear(x, wb, via)
        assert np.array_equal(via, by_copy)


@needs_fma
def test_bfloat16_keys_and_values_give_the_bits_of_their_float32_copies():
    from triforce.kernels.cpu.attention.f32_parts import scores_f32_fma, values_f32_fma
    rows, n = 9, 203
    q = _rand(rows, 64, seed=1)
    (kb, k32), (vb, v32) = _bf16(n, 64, seed=2), _bf16(n, 64, seed=3)
    p = np.abs(_rand(rows, 256, seed=4))
    outs = {}
    for name, k, v in (("bits", kb, vb), ("copy", k32, v32)):
        scores, acc = np.zeros((rows, 256), np.float32), np.zeros((rows, 64), np.float32)
        scores_f32_fma(q, k, n, scores)
        values_f32_fma(p, v, n, acc)
        outs[name] = scores[:, :n], acc
    assert all(np.array_equal(a, b) for a, b in zip(outs["bits"], outs["copy"]))
