"""SnapKV selection against a dense reference (no model)."""
import pytest
import torch
import torch.nn.functional as F

from triforce.cache import selection
from triforce.cache.selection import select_snapkv
from triforce.cache.sparse import SelectionPolicy


def dense_snapkv(window_queries, keys, budget, kernel=5):
    """Reference: each query head's whole causal softmax row by row, summed per KV head."""
    B, Hkv, S, D = keys.shape
    H, W = window_queries.shape[1], window_queries.shape[2]
    group, prefix = H // Hkv, S - W
    out = []
    for b in range(B):
        heads = []
        for h in range(Hkv):
            vote = torch.zeros(prefix, dtype=torch.float64)
            for g in range(group):
                for t in range(W):
                    q = window_queries[b, h * group + g, t].double()
                    logits = keys[b, h, :prefix + t + 1].double() @ q / D ** 0.5
                    vote += torch.softmax(logits, 0)[:prefix]
            pooled = F.avg_pool1d(vote[None, None], kernel, stride=1, padding=kernel // 2)[0, 0]
            picks = sorted(torch.topk(pooled, budget - W).indices.tolist())
            heads.append(picks + list(range(prefix, S)))
        out.append(heads)
    return torch.tensor(out)


@pytest.mark.parametrize("kept_bytes", [0, 64 << 20])  # the slices' logits made again, or kept
@pytest.mark.parametrize("slice_keys", [16, 8192])  # the softmax over several key slices, and in one
def test_snapkv_matches_the_dense_reference_with_gqa(monkeypatch, slice_keys, kept_bytes):
    monkeypatch.setattr(selection, "_SNAPKV_KEYS", slice_keys)
    monkeypatch.setattr(selection, "SNAPKV_KEPT_BYTES", kept_bytes)
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(2, 2, 90, 16, generator=g)
    window = torch.randn(2, 6, 8, 16, generator=g) * 2  # 3 query heads per KV head, 8-token window
    got = select_snapkv(window, keys, budget=40)
    assert torch.equal(got, dense_snapkv(window, keys, 40))
    assert got.shape == (2, 2, 40) and torch.all(got[..., 1:] > got[..., :-1])  # ascending, distinct


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_snapkv_finds_what_the_window_looks_at_and_its_neighbours(dtype):
    keys = torch.randn(1, 1, 300, 8, generator=torch.Generator().manual_seed(1)) * 0.1
    target = torch.ones(8)
    keys[0, 0, 120] = target * 3  # the one token every window query points at
    window = target.expand(1, 1, 32, 8).clone()
    got = select_snapkv(window.to(dtype), keys.to(dtype), budget=37)[0, 0].tolist()
    assert got[-32:] == list(range(268, 300))  # the window itself
    assert set(range(118, 123)) == set(got[:5])  # the token, and the pooling kernel's neighbours


def test_snapkv_bounds():
    keys = torch.randn(1, 1, 50, 8)
    assert torch.equal(select_snapkv(torch.randn(1, 1, 32, 8), keys, 60)[0, 0], torch.arange(50))
    with pytest.raises(ValueError, match="observation window"):
        select_snapkv(torch.randn(1, 1, 32, 8), keys, 30)
    with pytest.raises(ValueError, match="observation window"):
        SelectionPolicy("snapkv", 32)
    with pytest.raises(ValueError, match="window's queries"):
        SelectionPolicy("snapkv", 40).select(torch.randn(1, 1, 8), keys)
