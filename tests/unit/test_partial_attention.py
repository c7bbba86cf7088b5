"""Partial attention over key blocks merged by log-sum-exp equals one-shot attention."""
import pytest
import torch

from triforce.kernels import PartialAccumulator, attention, merge_partials, partial_attention
from test_attention import reference_attention


def random_qkv(T, S, seed=0, heads=4, kv_heads=2, dim=8):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, heads, T, dim, generator=g, dtype=torch.float64),
            torch.randn(1, kv_heads, S, dim, generator=g, dtype=torch.float64),
            torch.randn(1, kv_heads, S, dim, generator=g, dtype=torch.float64))


@pytest.mark.parametrize("T,S,window,cuts", [
    (1, 40, None, [0, 16, 32, 40]),       # one decode query, three streamed blocks
    (9, 64, None, [0, 8, 24, 55, 64]),    # a verify pass: the last block holds the new tokens
    (12, 50, 7, [0, 10, 20, 30, 50]),     # sliding window hides whole blocks from some queries
    (30, 30, None, [0, 30]),              # a prefill chunk with nothing before it
])
def test_merged_blocks_equal_one_shot_attention(T, S, window, cuts):
    q, k, v = random_qkv(T, S)
    parts = [partial_attention(q, k[:, :, a:b], v[:, :, a:b], scale=0.3, q_start=S - T, k_start=a,
                               sliding_window=window) for a, b in zip(cuts, cuts[1:])]
    got = merge_partials(parts, q.dtype)
    assert torch.allclose(got, reference_attention(q, k, v, 0.3, window), atol=1e-12)
    assert torch.allclose(got, attention(q, k, v, scale=0.3, sliding_window=window), atol=1e-12)


def test_tiling_does_not_change_the_result():
    q, k, v = random_qkv(20, 90, seed=1)
    whole = partial_attention(q, k, v, scale=0.2, q_start=70, k_start=0)
    tiled = partial_attention(q, k, v, scale=0.2, q_start=70, k_start=0, max_score_elements=64)
    assert torch.allclose(whole[0], tiled[0], atol=1e-12) and torch.allclose(whole[1], tiled[1], atol=1e-12)


def test_a_block_no_query_can_see_weighs_nothing():
    q, k, v = random_qkv(3, 20, seed=2)
    hidden = partial_attention(q, k[:, :, 15:], v[:, :, 15:], scale=0.3, q_start=5, k_start=15)
    assert torch.equal(hidden[0], torch.zeros_like(hidden[0])) and torch.isinf(hidden[1]).all()
    visible = partial_attention(q, k[:, :, :8], v[:, :, :8], scale=0.3, q_start=5, k_start=0)
    assert torch.allclose(merge_partials([visible, hidden], q.dtype),
                          reference_attention(q, k[:, :, :8], v[:, :, :8], 0.3), atol=1e-12)


def test_running_accumulator_equals_merging_at_once():
    q, k, v = random_qkv(4, 30, seed=3)
    parts = [partial_attention(q, k[:, :, a:a + 10], v[:, :, a:a + 10], scale=0.3, q_start=26, k_start=a)
             for a in (0, 10, 20)]
    acc = PartialAccumulator()
    for part in parts:
        acc.add(*part)
    assert torch.allclose(acc.result(q.dtype), merge_partials(parts, q.dtype), atol=1e-14)


def test_half_precision_inputs_merge_in_float32():
    q, k, v = (t.to(torch.bfloat16) for t in random_qkv(2, 24, seed=4))
    out, lse = partial_attention(q, k, v, scale=0.3, q_start=22, k_start=0)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    ref = reference_attention(q.double(), k.double(), v.double(), 0.3)
    assert torch.allclose(out.double(), ref, atol=1e-2)


def test_planner_tile_constant_matches_the_kernel():
    from triforce.kernels.partial import MAX_SCORE_ELEMENTS
    from triforce.plan.sizes import MAX_SCORE_ELEMENTS as planned
    assert planned == MAX_SCORE_ELEMENTS


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (4, 4)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_partial_of_a_whole_visible_block_matches_the_reference(heads, kv_heads, dtype):
    from triforce.kernels import SDPA
    from triforce.kernels.partial import partial_attention

    g = torch.Generator(device="cpu").manual_seed(5)
    q = torch.randn(1, heads, 3, 64, generator=g, device="cpu").to(dtype)
    store = torch.randn(40, 2, 1, kv_heads, 64, generator=g, device="cpu").to(dtype)  # token-major staging
    k, v = store[:, 0].permute(1, 2, 0, 3), store[:, 1].permute(1, 2, 0, 3)
    out, lse = SDPA.partial(q, k, v, scale=0.125, q_start=100, k_start=30)
    ref_out, ref_lse = partial_attention(q, k, v, scale=0.125, q_start=100, k_start=30)
    assert out.dtype == lse.dtype == torch.float32 and SDPA.fused_partial_failed is None
    torch.testing.assert_close(out, ref_out, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, ref_lse, atol=2e-2, rtol=1e-3)


@pytest.mark.parametrize("heads,kv_heads", [(6, 2), (4, 4)])
@pytest.mark.parametrize("q_start,k_start,num_keys,shape", [
    (100, 30, 40, "whole"),      # old tokens: every query sees every key
    (100, 100, 5, "diagonal"),   # a pass's own new tokens: the causal square alone
    (100, 60, 45, "diagonal"),   # keys from before the queries, then their own
])
def test_fused_float32_blocks_on_the_cpu_match_the_reference(heads, kv_heads, q_start, k_start, num_keys, shape):
    """Offloaded prefill and verify passes on the CPU take the flash kernel in float32 too, for
    old blocks and for the queries' own keys (masked by the kernel, the hidden half skipped)."""
    from triforce.kernels import SDPA
    from triforce.kernels.partial import fused_shape, partial_attention

    g = torch.Generator(device="cpu").manual_seed(7)
    q = torch.randn(1, heads, 5, 64, generator=g)
    k, v = torch.randn(2, 1, kv_heads, num_keys, 64, generator=g)
    assert fused_shape(q, num_keys, q_start, k_start, None) == shape
    out, lse = SDPA.partial(q, k, v, scale=0.125, q_start=q_start, k_start=k_start)
    ref_out, ref_lse = partial_attention(q.double(), k.double(), v.double(), scale=0.125, q_start=q_start,
                                         k_start=k_start)
    assert out.dtype == lse.dtype == torch.float32 and SDPA.fused_partial_failed is None
    torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)


class _OnCuda:
    """What fused_shape reads of a CUDA query (no CUDA here): shape, dtype, is_cuda."""
    def __init__(self, dtype):
        self.shape, self.dtype, self.is_cuda = (1, 4, 10, 64), dtype, True


@pytest.mark.parametrize("q,q_start,k_start,num_keys,window,expected", [
    (torch.empty(1, 4, 10, 64), 100, 30, 40, 50, None),          # a sliding window hides some keys
    (torch.empty(1, 4, 10, 64), 100, 30, 85, None, None),        # keys past the last query
    (torch.empty(1, 4, 10, 64), 100, 30, 0, None, None),         # no keys
    (torch.empty(1, 4, 10, 64, dtype=torch.float64), 100, 30, 40, None, None),  # float64: the reference
    (_OnCuda(torch.float32), 100, 30, 40, None, None),           # CUDA's flash kernel takes no float32
    (_OnCuda(torch.bfloat16), 100, 90, 20, None, "diagonal"),    # a pass's own keys fuse on CUDA too (issue 52)
    (_OnCuda(torch.bfloat16), 100, 30, 40, None, "whole"),
])
def test_which_blocks_the_fused_kernels_serve(q, q_start, k_start, num_keys, window, expected):
    from triforce.kernels.partial import fused_shape

    assert fused_shape(q, num_keys, q_start, k_start, window) == expected

