"""Attention backend choice (--attn) and the flash-attn wrapper's layout and mask routing,
checked against SDPA with a stand-in that follows flash_attn_func's documented contract
(flash-attn itself needs CUDA)."""
import pytest
import torch

from triforce.kernels import SDPA, FlashAttention, partial_attention, select_attention


class FakeFlash:
    """flash_attn_func's contract in plain torch: q [B, T, H, D], k, v [B, S, Hkv, D], causal
    bottom-right aligned, window_size=(left, right) with -1 for unbounded; lse [B, H, T]."""

    def __init__(self):
        self.calls = 0

    def __call__(self, q, k, v, softmax_scale, causal, window_size, return_attn_probs):
        assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 1
        self.calls += 1
        batch, num_q, heads, dim = q.shape
        num_k, kv_heads = k.shape[1], k.shape[2]
        qh = q.transpose(1, 2).double()
        kh = k.transpose(1, 2).double().repeat_interleave(heads // kv_heads, 1)
        vh = v.transpose(1, 2).double().repeat_interleave(heads // kv_heads, 1)
        scores = qh @ kh.transpose(-1, -2) * softmax_scale
        i = torch.arange(num_q)[:, None] + num_k - num_q
        j = torch.arange(num_k)[None, :]
        allowed = torch.ones(num_q, num_k, dtype=torch.bool)
        if causal:
            allowed &= j <= i
        left, right = window_size
        if left >= 0:
            allowed &= j >= i - left
        if right >= 0:
            allowed &= j <= i + right
        scores = scores.masked_fill(~allowed, float("-inf"))
        lse = torch.logsumexp(scores, -1)
        out = (torch.softmax(scores, -1) @ vh).transpose(1, 2).to(q.dtype)
        return (out, lse.float(), None) if return_attn_probs else out


class FakeKVCache:
    """flash_attn_with_kvcache's contract: k_cache, v_cache [B, S, Hkv, D]; the new k, v
    [B, T, Hkv, D] are written at rows cache_seqlens[b] + 0..T-1 and q attends (causal, bottom-right)
    over the first cache_seqlens[b] + T rows."""

    def __init__(self, flash):
        self.flash = flash

    def __call__(self, q, k_cache, v_cache, k, v, cache_seqlens, softmax_scale, causal):
        assert cache_seqlens.dtype == torch.int32 and k_cache.stride(-1) == 1
        outs = []
        for b in range(q.shape[0]):
            start = int(cache_seqlens[b])
            end = start + k.shape[1]
            k_cache[b, start:end], v_cache[b, start:end] = k[b], v[b]
            outs.append(self.flash(q[b:b + 1], k_cache[b:b + 1, :end], v_cache[b:b + 1, :end], softmax_scale,
                                   causal, (-1, -1), False))
        return torch.cat(outs)


def qkv(num_q, num_k, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, 4, num_q, 32, generator=g).to(dtype), torch.randn(1, 2, num_k, 32, generator=g).to(dtype),
            torch.randn(1, 2, num_k, 32, generator=g).to(dtype))


@pytest.mark.parametrize("num_q,num_k,window", [(1, 50, None), (5, 50, None), (7, 7, None), (5, 50, 9)])
def test_flash_attend_matches_sdpa(num_q, num_k, window):
    fake = FakeFlash()
    flash = FlashAttention(fake, FakeKVCache(fake), cuda_only=False)
    q, k, v = qkv(num_q, num_k)
    got = flash.attend(q, k, v, scale=0.2, sliding_window=window)
    ref = SDPA.attend(q.double(), k.double(), v.double(), scale=0.2, sliding_window=window)
    assert fake.calls == 1 and got.shape == q.shape and got.dtype == q.dtype
    torch.testing.assert_close(got.double(), ref, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("case,q_start,k_start,num_k,window,uses_flash", [
    ("block before every query", 100, 0, 64, None, True),
    ("new tokens, bottom-right causal", 100, 96, 9, None, True),
    ("block overlapping the queries, not aligned", 100, 90, 12, None, False),
    ("a window that binds", 100, 0, 64, 40, False),
    ("a window that does not bind", 100, 60, 40, 64, True),
])
def test_flash_partial_routes_and_matches_reference(case, q_start, k_start, num_k, window, uses_flash):
    fake = FakeFlash()
    flash = FlashAttention(fake, FakeKVCache(fake), cuda_only=False)
    q, k, v = qkv(5, num_k, seed=1)
    out, lse = flash.partial(q, k, v, scale=0.2, q_start=q_start, k_start=k_start, sliding_window=window)
    ref_out, ref_lse = partial_attention(q.double(), k.double(), v.double(), scale=0.2, q_start=q_start,
                                         k_start=k_start, sliding_window=window)
    assert fake.calls == int(uses_flash), case
    torch.testing.assert_close(out.double(), ref_out, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("start,num_new", [(0, 1), (13, 1), (20, 4)])
def test_flash_fixed_shape_attention_matches_sdpa(start, num_new):
    """The CUDA-graph path: flash's kv-cache kernel writes the new KV and attends like the masked SDPA."""
    fake = FakeFlash()
    flash = FlashAttention(fake, FakeKVCache(fake), cuda_only=False)
    q, k, v = qkv(num_new, num_new, seed=2)
    caches = []
    for backend in (flash, SDPA):
        k_cache, v_cache = (torch.randn(1, 2, 40, 32, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
                            for _ in range(2))
        slots = torch.arange(start, start + num_new)
        visible = torch.arange(40)[None, :] <= slots[:, None]
        out = backend.attend_fixed(q, k_cache, v_cache, k, v, slots=slots,
                                   cache_seqlens=torch.tensor([start], dtype=torch.int32), visible=visible, scale=0.2)
        caches.append((out, k_cache, v_cache))
    assert fake.calls == 1
    (fo, fk, fv), (so, sk, sv) = caches
    assert torch.equal(fk, sk) and torch.equal(fv, sv)
    torch.testing.assert_close(fo.double(), so.double(), rtol=2e-2, atol=2e-2)


def test_flash_leaves_float32_and_cpu_tensors_to_sdpa():
    fake = FakeFlash()
    q, k, v = qkv(3, 20, dtype=torch.float32)
    FlashAttention(fake, FakeKVCache(fake), cuda_only=False).attend(q, k, v, scale=0.2)
    q, k, v = qkv(3, 20)
    FlashAttention(fake, FakeKVCache(fake), cuda_only=True).attend(q, k, v, scale=0.2)  # bf16 but on the CPU
    assert fake.calls == 0


def test_select_attention():
    backend, line = select_attention("sdpa", torch.device("cpu"))
    assert backend is SDPA and "sdpa" in line
    backend, line = select_attention("auto", torch.device("cpu"))
    assert backend is SDPA and "CPU kernels" in line and "flash" not in line  # no CUDA library to miss here
    with pytest.raises(ValueError, match="--attn flash"):
        select_attention("flash", torch.device("cpu"))
    with pytest.raises(ValueError, match="unknown attention backend"):
        select_attention("fastest", torch.device("cpu"))
