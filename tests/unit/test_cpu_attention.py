"""The CPU decoding-attention kernel against float64 SDPA, its batch invariance (a query's result
does not depend on the other queries of the call), which calls it takes, and the default model
decoding the same tokens through it as through the reference SDPA path."""
import pytest
import torch
import torch.nn.functional as F

from triforce.config import SamplingParams, SpecParams
from triforce.decoding.engine import Engine
from triforce.kernels import SDPA, SdpaReference, attention, causal_mask
from triforce.kernels.cpu.attention import decode as cpu_attention
from triforce.kernels.cpu.attention.decode import SMALL_QUERIES, SPLIT, takes
from triforce.kernels.cpu.simd.amx import HAS_AMX

# Each bfloat16 case on both kernels this CPU may run: AMX tiles where it has them, the rest without
TILES = [False, pytest.param(True, marks=pytest.mark.skipif(not HAS_AMX, reason="this CPU has no AMX"))]


def _cache_views(dtype, keys, capacity, kv_heads=3, dim=64, seed=0):
    """k, v [1, Hkv, keys, D]: prefix views of [L, 1, Hkv, capacity, D] buffers, as caches hand out."""
    g = torch.Generator().manual_seed(seed)
    k_buf = torch.randn(2, 1, kv_heads, capacity, dim, generator=g).to(dtype)
    v_buf = torch.randn(2, 1, kv_heads, capacity, dim, generator=g).to(dtype)
    return k_buf[1, :, :, :keys], v_buf[1, :, :, :keys]


def _reference(q, k, v, scale):
    groups = q.shape[1] // k.shape[1]
    k64, v64 = (t.double().repeat_interleave(groups, 1) for t in (k, v))
    mask = causal_mask(q.shape[2], k.shape[2], q.device)
    return F.scaled_dot_product_attention(q.double(), k64, v64, attn_mask=mask, scale=scale)


@pytest.mark.parametrize("tiles", TILES)
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("keys, queries", [(keys, queries) for keys in (1, 7, SPLIT, SPLIT + 1, 3 * SPLIT - 5)
                                           for queries in (1, 3, SMALL_QUERIES) if queries <= keys])
def test_kernel_matches_float64(dtype, tol, keys, queries, tiles, monkeypatch):
    monkeypatch.setattr(cpu_attention, "HAS_AMX", tiles)
    k, v = _cache_views(dtype, keys, keys + 40)
    q = torch.randn(1, 9, queries, 64, generator=torch.Generator().manual_seed(keys)).to(dtype)
    assert takes(q, k, v, None)
    out = cpu_attention.attention(q, k, v, scale=0.125)
    assert out.shape == q.shape and out.dtype == dtype
    torch.testing.assert_close(out.double(), _reference(q, k, v, 0.125), rtol=tol, atol=tol)


@pytest.mark.parametrize("tiles", TILES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [64, 80])  # 80: the widening path on every CPU (see attend_kernel)
def test_a_query_gets_the_same_bits_alone_or_among_others(dtype, dim, tiles, monkeypatch):
    """Verifying T tokens computes each as decoding it alone would: what makes greedy
    speculation equal AR in bfloat16 (with the small-rows linear kernels)."""
    monkeypatch.setattr(cpu_attention, "HAS_AMX", tiles)
    keys, queries = 2 * SPLIT + 37, SMALL_QUERIES
    k, v = _cache_views(dtype, keys, keys + 8, dim=dim)
    q = torch.randn(1, 9, queries, dim, generator=torch.Generator().manual_seed(1)).to(dtype)
    together = cpu_attention.attention(q, k, v, scale=0.125)
    if dim == 80:  # the widening path against float64 too (the cases above run the one for 64)
        torch.testing.assert_close(together.double(), _reference(q, k, v, 0.125), rtol=2e-2, atol=2e-2)
    for t in range(queries):
        seen = keys - queries + t + 1
        alone = cpu_attention.attention(q[:, :, t:t + 1], k[:, :, :seen], v[:, :, :seen], scale=0.125)
        assert torch.equal(alone[:, :, 0], together[:, :, t]), f"query {t} differs"


def test_which_calls_it_takes():
    k, v = _cache_views(torch.float32, 100, 128)
    q = torch.randn(1, 9, 1, 64)
    assert takes(q, k, v, None) and takes(q, k, v, sliding_window=100)
    assert not takes(q, k, v, sliding_window=99)                       # the window hides keys
    assert not takes(torch.randn(1, 9, SMALL_QUERIES + 1, 64), k, v, None)  # prefill: SDPA's blocks
    assert not takes(q.double(), k.double(), v.double(), None)         # float64: the reference
    assert not takes(q.half(), k.half(), v.half(), None)
    assert not takes(torch.randn(2, 9, 1, 64), k.expand(2, -1, -1, -1), v.expand(2, -1, -1, -1), None)
    assert not takes(q, k.transpose(2, 3).contiguous().transpose(2, 3), v, None)  # rows not contiguous
    assert not takes(q, k, v[:, :, :99], None)                          # k and v disagree
    assert not takes(torch.randn(1, 8, 1, 64), k, v, None)              # heads not a multiple
    small_k, small_v = _cache_views(torch.float32, 100, 128, kv_heads=2, dim=16)
    assert not takes(torch.randn(1, 4, 1, 16), small_k, small_v, None)  # a test-sized model: SDPA
    tight = torch.randn(1, 3, 100, 64)[:, :, 2:]                        # the block would pass the storage
    assert not takes(q, tight, tight, None)


def test_calls_it_refuses_still_get_sdpa():
    k, v = _cache_views(torch.float32, 100, 128)
    q = torch.randn(1, 9, 1, 64)
    out = attention(q, k, v, scale=0.125, sliding_window=40)
    ref = F.scaled_dot_product_attention(q.double(), k.double().repeat_interleave(3, 1),
                                         v.double().repeat_interleave(3, 1), scale=0.125,
                                         attn_mask=causal_mask(1, 100, q.device, 40))
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    assert SdpaReference.cpu_kernel is False and SDPA.cpu_kernel is True


def test_default_model_decodes_the_same_through_kernel_and_reference(default_lm):
    ids = default_lm.tokenizer("The history of the printing press begins", add_special_tokens=False).input_ids
    tokens = {}
    try:
        for backend in (SdpaReference(), SDPA):
            default_lm.attn = backend
            engine = Engine(default_lm, SpecParams(method="ar"), len(ids) + 24)
            engine.set_sequence(ids)
            tokens[backend.name] = engine.generate(24, SamplingParams()).tokens
    finally:
        default_lm.attn = SDPA
    assert tokens["sdpa"] == tokens["sdpa-reference"]


def test_attn_sdpa_reference_selects_the_plain_path():
    from triforce.kernels import select_attention

    backend, line = select_attention("sdpa-reference", torch.device("cpu"))
    assert isinstance(backend, SdpaReference) and not backend.cpu_kernel and "every step" in line
    assert select_attention("sdpa", torch.device("cpu"))[0] is SDPA


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_warm_up_compiles_what_a_dtype_runs(dtype):
    from triforce.kernels.cpu.linear import dense as cpu_linear

    cpu_attention.warm_up(dtype)  # float64 has no kernel: nothing to do
    cpu_linear.warm_up(dtype)


def test_each_dtype_cpu_and_head_dim_compiles_one_path(monkeypatch):
    """A model's attention is one compiled kernel: the FMA one for float32 head dims that are a
    multiple of 64 on FMA CPUs, the bfloat16 pairs (for scores and values, or scores only) on
    CPUs with the bfloat16 dot, the widening one for everything else."""
    ca = cpu_attention
    monkeypatch.setattr(ca, "HAS_AMX", False)
    for fma in (True, False):
        monkeypatch.setattr(ca, "HAS_F32_FMA", fma)
        assert ca.attend_kernel(torch.float32, 64) is (ca._attend_f32_fma if fma else ca._attend_widened)
        assert ca.attend_kernel(torch.float32, 128) is (ca._attend_f32_fma if fma else ca._attend_widened)
        assert ca.attend_kernel(torch.float32, 80) is ca._attend_widened
    for dot in (True, False):
        for fma in (True, False):
            monkeypatch.setattr(ca, "HAS_BF16_DOT", dot)
            monkeypatch.setattr(ca, "HAS_F32_FMA", fma)
            widened = ca._attend_bf16_fma if fma else ca._attend_widened
            assert ca.attend_kernel(torch.bfloat16, 128) is (ca._attend_bf16_pairs if dot else widened)
            assert ca.attend_kernel(torch.bfloat16, 64) is (ca._attend_bf16_pairs if dot else widened)
            assert ca.attend_kernel(torch.bfloat16, 96) is (ca._attend_bf16_scores if dot else ca._attend_widened)
            assert ca.attend_kernel(torch.bfloat16, 80) is ca._attend_widened
    monkeypatch.setattr(ca, "HAS_AMX", True)  # AMX tiles: bfloat16 head dims that are a multiple of 32
    assert ca.attend_kernel(torch.bfloat16, 64) is ca.attend_kernel(torch.bfloat16, 96) is ca._attend_amx
    assert ca.attend_kernel(torch.bfloat16, 80) is not ca._attend_amx
    assert ca.attend_kernel(torch.float32, 64) is not ca._attend_amx


@pytest.mark.skipif(not HAS_AMX, reason="this CPU has no AMX")
@pytest.mark.parametrize("dim, queries", [(64, 1), (64, 9), (96, 6), (128, 16)])
def test_amx_tiles_never_read_the_cache_past_the_view(dim, queries):
    """The tiles take 16 keys and up to 16 query rows at a time: slots past the view (here NaN,
    as an unwritten cache may hold) and rows past the call's never reach a result; 6 and 16
    tokens of 3 rows take two and three row blocks, head dims 96 and 128 three and four passes."""
    keys = SPLIT + 21
    k_buf, v_buf = (torch.randn(1, 3, keys + 40, dim).bfloat16() for _ in range(2))
    k_buf[:, :, keys:], v_buf[:, :, keys:] = float("nan"), float("inf")
    k, v = k_buf[:, :, :keys], v_buf[:, :, :keys]
    q = torch.randn(1, 9, queries, dim).bfloat16()
    assert cpu_attention.attend_kernel(torch.bfloat16, dim) is cpu_attention._attend_amx
    out = cpu_attention.attention(q, k, v, scale=dim ** -0.5)
    torch.testing.assert_close(out.double(), _reference(q, k, v, dim ** -0.5), rtol=2e-2, atol=2e-2)


@pytest.mark.skipif(not cpu_attention.HAS_F32_FMA, reason="this CPU has no FMA/AVX2")
@pytest.mark.parametrize("queries", [1, 9])
def test_bfloat16_on_the_fma_path_is_the_float32_result_of_its_values_rounded_once(monkeypatch, queries):
    """Without the bfloat16 dot, a job widens its keys and values into float32 scratch for the FMA
    kernels: exactly what float32 copies of q, k and v give, rounded to bfloat16 once."""
    monkeypatch.setattr(cpu_attention, "HAS_BF16_DOT", False)
    monkeypatch.setattr(cpu_attention, "HAS_AMX", False)
    keys = 2 * SPLIT + 37
    k, v = _cache_views(torch.bfloat16, keys, keys + 8)
    q = torch.randn(1, 9, queries, 64, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    assert cpu_attention.attend_kernel(torch.bfloat16, 64) is cpu_attention._attend_bf16_fma
    got = cpu_attention.attention(q, k, v, scale=0.125)
    k32, v32 = (t.float().contiguous() for t in (k, v))
    want = cpu_attention.attention(q.float(), k32, v32, scale=0.125).to(torch.bfloat16)
    assert torch.equal(got, want)


def test_warm_up_compiles_only_the_kernels_the_models_take():
    """A fresh process (kernels from the suite's numba cache): warming a 3 x 64 float32 model
    gives the path attend_kernel names a signature and no other; a model too narrow for the kernel
    (2 x 16) warms nothing."""
    import subprocess
    import sys

    script = """
import torch
from triforce.kernels.cpu.attention import decode as ca
ca.warm_up(torch.float32, [(2, 16)])
print(sum(len(k.signatures) for k in (ca._attend_widened, ca._attend_f32_fma)))
ca.warm_up(torch.float32, [(3, 64)])
print(ca._attend_widened.signatures == [] or ca.attend_kernel(torch.float32, 64) is ca._attend_widened)
print(len(ca.attend_kernel(torch.float32, 64).signatures))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["0", "True", "1"]


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("keys, queries", [(SPLIT + 40, SMALL_QUERIES + 1), (3 * SPLIT - 5, 200)])
def test_a_later_prefill_chunk_matches_float64_whole_or_in_pieces(dtype, tol, keys, queries, monkeypatch):
    """prefill_attention against float64 SDPA; its pieces (a small PREFILL_SCRATCH) give every
    query the bits the whole chunk gives it."""
    k, v = _cache_views(dtype, keys, keys + 24)
    q = torch.randn(1, 9, queries, 64, generator=torch.Generator().manual_seed(queries)).to(dtype)
    whole = cpu_attention.prefill_attention(q, k, v, scale=0.125)
    assert whole.shape == q.shape and whole.dtype == dtype
    torch.testing.assert_close(whole.double(), _reference(q, k, v, 0.125), rtol=tol, atol=tol)
    splits = (keys + SPLIT - 1) // SPLIT
    monkeypatch.setattr(cpu_attention, "PREFILL_SCRATCH", 7 * 9 * splits * 64 * 4)  # 7 queries a piece
    assert torch.equal(cpu_attention.prefill_attention(q, k, v, scale=0.125), whole)


def test_which_prefill_chunks_it_takes(monkeypatch):
    """bfloat16 chunks after the first, on the CPU's bfloat16 dot without AMX (the device decision
    taken both ways whatever this CPU has); never float32, a first chunk, a verify's few rows or a
    window, nor where torch's flash kernel has AMX (3.3-3.8x this kernel's speed on a Xeon)."""
    monkeypatch.setattr(cpu_attention, "HAS_BF16_DOT", True)
    monkeypatch.setattr(cpu_attention, "SDPA_ON_AMX", False)
    k, v = _cache_views(torch.bfloat16, 300, 320)
    q = torch.randn(1, 9, 40, 64).bfloat16()
    assert cpu_attention.takes_prefill(q, k, v, None)
    assert not cpu_attention.takes_prefill(q[:, :, :SMALL_QUERIES], k, v, None)    # a verify: `takes`
    assert not cpu_attention.takes_prefill(q.float(), k.float(), v.float(), None)   # float32: SDPA ran faster
    assert not cpu_attention.takes_prefill(q, k[:, :, :40], v[:, :, :40], None)     # the first chunk: SDPA
    assert not cpu_attention.takes_prefill(q, k, v, sliding_window=100)             # a window hides keys
    routed = []
    monkeypatch.setattr(cpu_attention, "prefill_attention", lambda *a, **kw: routed.append(a[0].shape[2]) or a[0])
    attention(q, k, v, scale=0.125)
    assert routed == [40]
    monkeypatch.setattr(cpu_attention, "SDPA_ON_AMX", True)  # an AMX CPU: flash
    assert not cpu_attention.takes_prefill(q, k, v, None)
    monkeypatch.setattr(cpu_attention, "SDPA_ON_AMX", False)
    monkeypatch.setattr(cpu_attention, "HAS_BF16_DOT", False)  # a CPU without the instruction: flash, as before
    assert not cpu_attention.takes_prefill(q, k, v, None)
    attention(q, k, v, scale=0.125)
    assert routed == [40]
