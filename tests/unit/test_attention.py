import torch

from triforce.kernels import attention, causal_mask


def reference_attention(q, k, v, scale, window=None):
    """Plain loop over queries: softmax over the keys each may see."""
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    T, S = q.shape[2], k.shape[2]
    out = torch.empty_like(q)
    for i in range(T):
        pos = S - T + i
        lo = 0 if window is None else max(0, pos - window + 1)
        scores = (q[:, :, i:i + 1] @ k[:, :, lo:pos + 1].transpose(-1, -2)) * scale
        out[:, :, i:i + 1] = scores.softmax(-1) @ v[:, :, lo:pos + 1]
    return out


def test_attention_matches_loop_reference_for_every_shape():
    g = torch.Generator().manual_seed(0)
    for T, S, window in [(1, 1, None), (1, 9, None), (5, 5, None), (4, 11, None), (6, 20, 5), (1, 20, 5)]:
        q = torch.randn(1, 4, T, 8, generator=g, dtype=torch.float64)
        k = torch.randn(1, 2, S, 8, generator=g, dtype=torch.float64)
        v = torch.randn(1, 2, S, 8, generator=g, dtype=torch.float64)
        got = attention(q, k, v, scale=0.3, sliding_window=window)
        assert torch.allclose(got, reference_attention(q, k, v, 0.3, window), atol=1e-12), (T, S, window)


def test_causal_mask_is_bottom_right_aligned():
    mask = causal_mask(2, 4, torch.device("cpu"))
    assert mask.tolist() == [[True, True, True, False], [True, True, True, True]]


def test_a_later_prefill_chunk_on_the_cpu_takes_the_kernels_own_causal_mask(monkeypatch):
    """A chunk of more than SMALL_QUERIES new tokens after earlier ones (float32/bfloat16 on the
    CPU): the keys before it whole, its own keys as a causal square; the same attention."""
    import importlib

    module = importlib.import_module("triforce.kernels.attention")  # the package exports the function
    calls = []
    real = module.fused_partial
    monkeypatch.setattr(module, "fused_partial", lambda *a, **kw: calls.append(kw["shape"]) or real(*a, **kw))
    g = torch.Generator().manual_seed(1)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        q = torch.randn(1, 6, 40, 32, generator=g).to(dtype)
        k, v = torch.randn(2, 1, 2, 100, 32, generator=g).to(dtype)
        got = attention(q, k, v, scale=0.2)
        expected = reference_attention(q.double(), k.double(), v.double(), 0.2)
        assert got.dtype == dtype and torch.allclose(got.double(), expected, atol=tol, rtol=tol)
    assert calls == ["diagonal", "diagonal"]
    attention(q[:, :, :16], k, v, scale=0.2)  # a verify pass's few queries keep their own path
    attention(q.float(), k.float(), v.float(), scale=0.2, sliding_window=50)  # a window hides keys
    assert calls == ["diagonal", "diagonal"]
