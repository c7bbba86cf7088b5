"""The offloaded cache against the resident full cache, with random tensors (no model): the same
writes give the same attention, reads, selections and rollbacks, for every schedule."""
import dataclasses

import pytest
import torch
from transformers import LlamaConfig

from triforce.cache.resident import ResidentKVCache
from triforce.cache.sparse import SelectionPolicy, SparseKVCache
from triforce.config.model import ModelConfig
from triforce.cache.offloaded import OffloadedKVCache

HF = LlamaConfig(vocab_size=10, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
CFG = ModelConfig.from_hf(HF)
WINDOWED = dataclasses.replace(CFG, sliding_windows=(None, 11))
D = CFG.head_dim


def feed(caches, num_new, seed, chunks=None, prefill=False):
    """The same random q, k, v through every cache's step; chunks: layer-major pieces per layer.
    Returns each cache's outputs [layer][piece]."""
    g = torch.Generator().manual_seed(seed)
    chunks = chunks or [num_new]
    steps = [c.step(num_new, prefill=prefill) for c in caches]
    outs = [[] for _ in caches]
    for layer in range(CFG.num_layers):
        for n in chunks:
            q, k, v = (torch.randn(1, h, n, D, generator=g, dtype=torch.float64) for h in (4, 2, 2))
            for i, step in enumerate(steps):
                outs[i].append(step.attend(layer, q, k, v))
    return outs


def pair(cfg=CFG, max_len=80, resident=16, block=8, overlap=True, decode_resident=0):
    return (ResidentKVCache(cfg, max_len, dtype=torch.float64),
            OffloadedKVCache(cfg, max_len, resident, block, dtype=torch.float64, device="cpu", overlap=overlap,
                             pin=False, decode_resident_tokens=decode_resident))


def assert_same(outs):
    for a, b in zip(*outs):
        assert torch.allclose(a, b, atol=1e-12)


@pytest.mark.parametrize("cfg", [CFG, WINDOWED], ids=["full-attention", "sliding-window"])
@pytest.mark.parametrize("overlap", [True, False])
def test_prefill_decode_rollback_equal_the_resident_cache(cfg, overlap):
    full, off = pair(cfg, overlap=overlap)
    assert_same(feed([full, off], 30, seed=0))             # prefill across the resident boundary
    for seed in range(1, 6):                               # verify passes of 5, rolled back to 3
        off.prepare_verify()
        assert_same(feed([full, off], 5, seed=seed))
        full.rollback(full.length - 2)
        off.rollback(off.length - 2)
    assert off.length == full.length == 45
    k_full, v_full = full.kv_range(10, 45)
    k_off, v_off = off.kv_range(10, 45)
    assert torch.equal(k_full, k_off) and torch.equal(v_full, v_off)


def test_layer_major_prefill_equals_token_major():
    full, off = pair(max_len=90, resident=16, block=8)
    feed([full, off], 20, seed=0)
    # 37 new tokens, fed layer by layer in chunks, after 20 tokens already split over both homes
    outs = feed([full, off], 37, seed=1, chunks=[10, 10, 17])
    assert_same(outs)
    assert torch.equal(full.kv_range(0, 57)[0], off.kv_range(0, 57)[0])


def test_prefetched_blocks_are_used_and_stale_ones_are_not():
    full, off = pair(max_len=100, resident=8, block=8)
    feed([full, off], 40, seed=0)
    off.prepare_verify()
    before = dataclasses.replace(off.prefetcher.stats)
    assert_same(feed([full, off], 4, seed=1))
    stats = off.prefetcher.stats
    assert stats.misses == before.misses and stats.hits > before.hits  # everything was fetched ahead
    # the last block now holds new tokens: a buffer that still holds its old copy must not be used
    off.prepare_verify()
    assert_same(feed([full, off], 4, seed=2))


def test_overlapped_and_plain_schedules_move_the_same_bytes():
    runs = []
    for overlap in (True, False):
        full, off = pair(max_len=100, resident=8, block=8, overlap=overlap)
        outs = feed([full, off], 40, seed=0)
        for seed in range(1, 4):
            off.prepare_verify()
            outs += feed([full, off], 3, seed=seed)
        runs.append((outs, off.prefetcher.stats))
    (outs_a, stats_a), (outs_b, stats_b) = runs
    for a, b in zip(outs_a, outs_b):
        for x, y in zip(a, b):
            assert torch.equal(x, y)
    assert stats_a.h2d_bytes == stats_b.h2d_bytes and stats_a.d2h_bytes == stats_b.d2h_bytes


@pytest.mark.parametrize("cfg", [CFG, WINDOWED], ids=["full-attention", "sliding-window"])
@pytest.mark.parametrize("group_bytes", [None, 1], ids=["layers-at-once", "a-layer-a-group"])
@pytest.mark.parametrize("kind", ["retrieval", "streaming"])
def test_sparse_rebuild_from_the_offloaded_cache_equals_from_the_resident_one(kind, group_bytes, cfg, monkeypatch):
    """A rebuild gathers every layer's selection through one wait for their indices (or a group's:
    group_bytes shrinks the groups to a layer each); the same KV as from the resident cache."""
    if group_bytes is not None:
        from triforce.cache import offloaded
        monkeypatch.setattr(offloaded, "GATHER_GROUP_BYTES", group_bytes)
    full, off = pair(cfg, max_len=120, resident=16, block=8)
    feed([full, off], 70, seed=0)
    policy = SelectionPolicy(kind, budget=24, chunk_size=4, sink_tokens=4)
    queries = [torch.randn(1, 4, D, dtype=torch.float64, generator=torch.Generator().manual_seed(l))
               for l in range(2)]
    sparse = [SparseKVCache(cfg, policy, 8, dtype=torch.float64) for _ in range(2)]
    for cache, source in zip(sparse, (full, off)):
        cache.rebuild(source, queries)
    assert torch.equal(sparse[0].k_buf, sparse[1].k_buf) and torch.equal(sparse[0].v_buf, sparse[1].v_buf)
    for layer in range(2):
        assert torch.allclose(full.chunk_scores(layer, queries[layer], 4), off.chunk_scores(layer, queries[layer], 4),
                              atol=1e-12)


def test_chunk_means_follow_rollbacks():
    full, off = pair(max_len=120, resident=16, block=8)
    feed([full, off], 60, seed=0)
    query = torch.randn(1, 4, D, dtype=torch.float64)
    off.chunk_scores(0, query, 4)                       # means cached up to token 60
    full.rollback(30)
    off.rollback(30)
    feed([full, off], 30, seed=9)                       # different tokens where the old ones were
    assert torch.allclose(full.chunk_scores(0, query, 4), off.chunk_scores(0, query, 4), atol=1e-12)


def test_chunk_size_that_does_not_divide_the_blocks_is_refused():
    _, off = pair(resident=16, block=8)
    feed([off], 30, seed=0)
    with pytest.raises(ValueError, match="chunk-size 3"):
        off.chunk_scores(0, torch.randn(1, 4, D, dtype=torch.float64), 3)


def test_kv_range_of_a_verify_pass_comes_from_the_device(monkeypatch):
    full, off = pair(max_len=200, resident=16, block=8)
    feed([full, off], 90, seed=0, prefill=True)   # a prefill: its KV is not kept on the device
    host_reads = []
    real_read = off.store.read
    monkeypatch.setattr(off.store, "read", lambda s, e: host_reads.append((s, e)) or real_read(s, e))
    assert torch.equal(off.kv_range(20, 90)[0], full.kv_range(20, 90)[0])
    assert host_reads == [(20, 90)]
    feed([full, off], 5, seed=1)                  # a verify pass of 5 tokens, then 2 rejected
    full.rollback(93)
    off.rollback(93)
    for start, end in ((90, 93), (91, 92)):
        k, v = off.kv_range(start, end)
        assert torch.equal(k, full.kv_range(start, end)[0]) and torch.equal(v, full.kv_range(start, end)[1])
    assert len(host_reads) == 1                   # served by the pass's device copies
    assert torch.equal(off.kv_range(85, 93)[0], full.kv_range(85, 93)[0])
    assert host_reads[-1] == (85, 93)             # reaches before the pass: read back from the host
    feed([full, off], 5, seed=2, prefill=True)    # a short prefill is still a prefill: said, not guessed
    assert torch.equal(off.kv_range(93, 98)[0], full.kv_range(93, 98)[0])
    assert host_reads[-1] == (93, 98)


def test_top_k_selection_reads_the_offloaded_cache_like_the_resident_one():
    """The top-k policy reads every key (`keys`); the offloaded cache once lacked it."""
    full, off = pair(max_len=100, resident=16, block=8)
    feed([full, off], 60, seed=0)
    assert torch.equal(full.keys(1), off.keys(1))
    policy = SelectionPolicy("topk", 24, 4, 4)
    query = [torch.randn(1, 4, D, dtype=torch.float64) for _ in range(CFG.num_layers)]
    built = []
    for cache in (full, off):
        sparse = SparseKVCache(CFG, policy, 8, dtype=torch.float64)
        sparse.rebuild(cache, query)
        built.append(sparse)
    assert torch.equal(built[0].k_buf, built[1].k_buf) and torch.equal(built[0].v_buf, built[1].v_buf)


@pytest.mark.parametrize("cfg", [CFG, WINDOWED], ids=["full-attention", "sliding-window"])
def test_blocks_moved_after_prefill_attend_like_the_resident_cache(cfg):
    """Residency after prefill: whole host blocks move to the device at the first short pass, up
    to the room the plan gives (2 blocks here); a rollback below them forgets them and a later
    prefill (a chat turn) frees them, and every output stays the resident cache's."""
    full, off = pair(cfg, max_len=100, decode_resident=32)
    assert_same(feed([full, off], 30, seed=0, prefill=True))
    assert off.ext_tokens == 0                             # nothing moves during a prefill
    moved = []
    for seed in range(1, 6):
        off.prepare_verify()
        assert_same(feed([full, off], 5, seed=seed))
        moved.append(off.ext_tokens)
    assert moved == [8, 16, 16, 16, 16] and off.device_tokens == 32
    full.rollback(20)
    off.rollback(20)
    assert off.ext_tokens == 0                             # block 16..24 will be rewritten
    assert_same(feed([full, off], 12, seed=7))
    assert off.ext_tokens == 0 and off.k_ext is not None  # promoted again at the next short pass only
    assert_same(feed([full, off], 3, seed=8))
    assert off.ext_tokens == 16
    assert_same(feed([full, off], 20, seed=9, prefill=True))  # a chat turn: the copies give way
    assert off.k_ext is None
    assert_same(feed([full, off], 2, seed=10))
    assert torch.equal(full.kv_range(0, off.length)[0], off.kv_range(0, off.length)[0])


def test_moved_blocks_are_not_streamed_and_only_filled_tokens_are():
    """A pass reads host blocks up to its first new token: with two blocks moved to the device
    only the third streams, and of it only its 5 filled tokens."""
    streamed = []
    for decode_resident in (0, 32):
        full, off = pair(max_len=100, decode_resident=decode_resident)
        feed([full, off], 37, seed=0, prefill=True)        # host tokens 16..37: blocks of 8, 8 and 5
        before = off.prefetcher.stats.h2d_bytes
        assert_same(feed([full, off], 1, seed=1))
        streamed.append(off.prefetcher.stats.h2d_bytes - before)
    per_token = CFG.num_layers * off.store.block(0, 0)[0].nbytes
    assert streamed == [21 * per_token, 5 * per_token]
