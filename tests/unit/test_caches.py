"""Cache storage bookkeeping with random tensors (no model): rollback, rebuild, eviction."""
import pytest
import torch
from transformers import LlamaConfig

from triforce.cache.resident import ResidentKVCache
from triforce.cache.sparse import SelectionPolicy, SparseKVCache
from triforce.cache.streaming import StreamingKVCache
from triforce.config import ModelConfig
from triforce.kernels import attention
from triforce.model.rope import RotaryEmbedding, apply_rope

HF = LlamaConfig(vocab_size=10, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
CFG = ModelConfig.from_hf(HF)
D = CFG.head_dim


def fill(cache, n, seed=0):
    """Write n random tokens through the step interface; returns (k, v) per layer."""
    g = torch.Generator().manual_seed(seed)
    step = cache.step(n)
    written = []
    for layer in range(CFG.num_layers):
        k = torch.randn(1, 2, n, D, generator=g, dtype=torch.float64)
        v = torch.randn(1, 2, n, D, generator=g, dtype=torch.float64)
        q = torch.randn(1, 4, n, D, generator=g, dtype=torch.float64)
        step.attend(layer, q, k, v)
        written.append((k, v))
    return step, written


def test_full_cache_rollback_and_overflow():
    cache = ResidentKVCache(CFG, 20, dtype=torch.float64)
    _, first = fill(cache, 12)
    fill(cache, 5, seed=1)
    cache.rollback(12)
    assert cache.length == 12 and torch.equal(cache.keys(1), first[1][0])
    with pytest.raises(Exception, match="context full"):
        cache.step(9)
    with pytest.raises(ValueError):
        cache.rollback(13)


def test_sparse_cache_gathers_selection_appends_and_rolls_back():
    full = ResidentKVCache(CFG, 100, dtype=torch.float64)
    fill(full, 60)
    sparse = SparseKVCache(CFG, SelectionPolicy("streaming", budget=12, sink_tokens=4), 20, dtype=torch.float64)
    sparse.rebuild(full, None)
    assert sparse.num_selected == 12 and sparse.length == sparse.build_point == 60
    expected = torch.cat([full.keys(0)[:, :, :4], full.keys(0)[:, :, 52:60]], 2)
    assert torch.equal(sparse.k_buf[0, :, :, :12], expected)
    fill(full, 3, seed=2)
    sparse.append_from(full, 60, 63)
    assert sparse.end == 15 and torch.equal(sparse.k_buf[1, :, :, 12:15], full.keys(1)[:, :, 60:63])
    step = sparse.step(2)
    assert step.positions.tolist() == [[63, 64]]
    sparse.rollback(63)
    assert sparse.end == 15
    with pytest.raises(ValueError):
        sparse.rollback(59)  # below the selection: needs a rebuild


def test_sparse_attention_equals_attention_over_the_gathered_keys():
    full = ResidentKVCache(CFG, 100, dtype=torch.float64)
    fill(full, 50)
    policy = SelectionPolicy("retrieval", budget=24, chunk_size=4)
    sparse = SparseKVCache(CFG, policy, 8, dtype=torch.float64)
    query = [torch.randn(1, 4, D, dtype=torch.float64) for _ in range(2)]
    sparse.rebuild(full, query)
    idx = policy.select(query[1], full.keys(1))
    gathered_k = torch.stack([full.keys(1)[0, h, idx[0, h]] for h in range(2)])[None]
    gathered_v = torch.stack([full.values(1)[0, h, idx[0, h]] for h in range(2)])[None]
    q, k, v = (torch.randn(1, h, 1, D, dtype=torch.float64) for h in (4, 2, 2))
    got = sparse.step(1).attend(1, q, k, v)
    ref = attention(q, torch.cat([gathered_k, k], 2), torch.cat([gathered_v, v], 2), scale=D ** -0.5)
    assert torch.allclose(got, ref, atol=1e-12)


def test_streaming_eviction_keeps_relative_positions():
    """After the window slides, attention equals attention over keys rotated at their new slots."""
    rope = RotaryEmbedding(HF)
    cache = StreamingKVCache(CFG, rope, sink_tokens=2, window=6, slack=3, dtype=torch.float64)
    g = torch.Generator().manual_seed(3)
    raw = []  # pre-RoPE keys of every token fed, layer 0
    for _ in range(14):
        step = cache.step(1)
        cos, sin = rope.cos_sin(step.positions, torch.float64)
        k_raw = torch.randn(1, 2, 1, D, generator=g, dtype=torch.float64)
        raw.append(k_raw)
        for layer in range(2):
            step.attend(layer, torch.randn(1, 4, 1, D, dtype=torch.float64), apply_rope(k_raw, cos, sin),
                        torch.zeros(1, 2, 1, D, dtype=torch.float64))
    held = [0, 1] + list(range(14 - (cache.end - 2), 14))  # sinks, then the most recent tokens
    assert cache.length == 14 and cache.end == len(held) <= cache.capacity
    for slot, token in enumerate(held):
        cos, sin = rope.cos_sin(torch.tensor([[slot]]), torch.float64)
        assert torch.allclose(cache.k_buf[0, :, :, slot:slot + 1], apply_rope(raw[token], cos, sin), atol=1e-10)
    cache.rollback(12)
    assert cache.end == len(held) - 2


def test_streaming_rollback_past_the_window_is_refused():
    cache = StreamingKVCache(CFG, RotaryEmbedding(HF), sink_tokens=2, window=4, slack=2, dtype=torch.float64)
    fill(cache, 6)
    with pytest.raises(ValueError):
        cache.rollback(1)
