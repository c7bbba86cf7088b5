"""Cache storage bookkeeping with random tensors (no model): rollback, rebuild, eviction."""
import pytest
import torch
from transformers import LlamaConfig

from triforce.cache.resident import ResidentKVCache
from triforce.cache.sparse import SelectionPolicy, SparseKVCache
from triforce.cache.streaming import StreamingKVCache
from triforce.config.model import ModelConfig
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


def _local_rope():
    """A second RoPE (Gemma 3's local layers turn with a base of their own)."""
    return RotaryEmbedding(LlamaConfig(**{**HF.to_dict(), "rope_parameters": {"rope_type": "default",
                                                                             "rope_theta": 50.0}}))


@pytest.mark.parametrize("per_layer", [False, True], ids=["one-rope", "rope-per-layer"])
def test_streaming_eviction_keeps_relative_positions(per_layer):
    """After the window slides, attention equals attention over keys rotated at their new slots,
    each layer's by its own RoPE."""
    ropes = (RotaryEmbedding(HF), _local_rope()) if per_layer else (RotaryEmbedding(HF),) * 2
    cache = StreamingKVCache(CFG, ropes if per_layer else ropes[0], sink_tokens=2, window=6, slack=3,
                             dtype=torch.float64)
    g = torch.Generator().manual_seed(3)
    raw = []  # pre-RoPE keys of every token fed, per layer
    for _ in range(14):
        step = cache.step(1)
        raw.append([torch.randn(1, 2, 1, D, generator=g, dtype=torch.float64) for _ in range(2)])
        for layer in range(2):
            cos, sin = ropes[layer].cos_sin(step.positions, torch.float64)
            step.attend(layer, torch.randn(1, 4, 1, D, dtype=torch.float64), apply_rope(raw[-1][layer], cos, sin),
                        torch.zeros(1, 2, 1, D, dtype=torch.float64))
    held = [0, 1] + list(range(14 - (cache.end - 2), 14))  # sinks, then the most recent tokens
    assert cache.length == 14 and cache.end == len(held) <= cache.capacity
    for layer in range(2):
        for slot, token in enumerate(held):
            cos, sin = ropes[layer].cos_sin(torch.tensor([[slot]]), torch.float64)
            assert torch.allclose(cache.k_buf[layer, :, :, slot:slot + 1], apply_rope(raw[token][layer], cos, sin),
                                  atol=1e-10), (layer, slot)
    cache.rollback(12)
    assert cache.end == len(held) - 2


def test_streaming_rollback_past_the_window_is_refused():
    cache = StreamingKVCache(CFG, RotaryEmbedding(HF), sink_tokens=2, window=4, slack=2, dtype=torch.float64)
    fill(cache, 6)
    with pytest.raises(ValueError):
        cache.rollback(1)


WINDOWED = ModelConfig.from_hf(LlamaConfig(**{**HF.to_dict(), "layer_types": ["sliding_attention", "full_attention"],
                                              "sliding_window": 10}))


@pytest.mark.parametrize("kind", ["retrieval", "streaming"])
def test_a_windowed_layer_of_a_sparse_tier_keeps_its_latest_tokens_and_is_exact(kind):
    """Layer 0 sees a 10-token window: with a budget of 16 it holds the latest tokens, in order,
    and attends through its window (as the target does), so its output equals the full cache's, also
    after tokens are appended; layer 1 (global) keeps the policy's choice."""
    assert WINDOWED.sliding_windows == (10, None)
    full = ResidentKVCache(WINDOWED, 100, dtype=torch.float64)
    fill(full, 50)
    policy = SelectionPolicy(kind, budget=16, chunk_size=4, sink_tokens=4)
    sparse = SparseKVCache(WINDOWED, policy, 8, dtype=torch.float64)
    queries = [torch.randn(1, 4, D, dtype=torch.float64) for _ in range(2)]
    sparse.rebuild(full, queries)
    n = sparse.num_selected  # as many as the policy picks for layer 1 (retrieval: whole chunks and the last part)
    assert 10 <= n <= 16 and torch.equal(sparse.k_buf[0, :, :, :n], full.keys(0)[:, :, 50 - n:50])
    picked = policy.select(queries[1], full.keys(1))
    assert torch.equal(sparse.k_buf[1, :, :, :n], torch.stack([full.keys(1)[0, h, picked[0, h]] for h in range(2)])[None])
    assert not torch.equal(picked[0, 0], torch.arange(50 - n, 50))  # the global layer's pick differs
    for appended in range(3):
        q, k, v = (torch.randn(1, h, 1, D, dtype=torch.float64) for h in (4, 2, 2))
        got = sparse.step(1).attend(0, q, k, v)
        full_step = full.step(1)
        want = full_step.attend(0, q, k, v)
        assert torch.allclose(got, want, atol=1e-12), appended
        full_step.attend(1, q, k, v)
        sparse.rollback(sparse.length - 1)
        sparse.append_from(full, full.length - 1, full.length)


def test_a_window_longer_than_the_context_leaves_the_layer_to_the_policy():
    full = ResidentKVCache(WINDOWED, 100, dtype=torch.float64)
    fill(full, 8)
    sparse = SparseKVCache(WINDOWED, SelectionPolicy("streaming", budget=6, sink_tokens=2), 8, dtype=torch.float64)
    sparse.rebuild(full, None)
    assert sparse.windowed == (None, None)
    assert torch.equal(sparse.k_buf[0, :, :, :6], torch.cat([full.keys(0)[:, :, :2], full.keys(0)[:, :, 4:8]], 2))
