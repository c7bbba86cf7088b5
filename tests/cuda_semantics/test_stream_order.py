"""The prefetcher's CUDA schedule run under the checked streams fake: the offloaded cache gives the
resident cache's results with every copy ordered, and planted bugs (one wait removed) fail."""
import dataclasses

import pytest
import torch
from transformers import LlamaConfig

from checked_streams import CopyDisciplineError, StreamOrderError
from triforce.cache.resident import ResidentKVCache
from triforce.config.model import ModelConfig
from triforce.cache.offloaded import OffloadedKVCache
from triforce.offload.prefetcher import Prefetcher
from triforce.pinned import HostKVStore

HF = LlamaConfig(vocab_size=10, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
CFG = ModelConfig.from_hf(HF)
WINDOWED = dataclasses.replace(CFG, sliding_windows=(None, 11, None))


def feed(caches, num_new, seed, cfg=CFG, group=None):
    """One pass of num_new tokens; with group, a layer-major prefill whose every layer attends in
    query groups of that many tokens (each group streams the layer's host blocks again)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    steps = [c.step(num_new, prefill=group is not None) for c in caches]
    outs = [[] for _ in caches]
    for layer in range(cfg.num_layers):
        for first in range(0, num_new, group or num_new):
            n = min(group or num_new, num_new - first)
            q, k, v = (torch.randn(1, h, n, cfg.head_dim, generator=g, dtype=torch.float64, device="cpu")
                       for h in (4, 2, 2))
            for i, step in enumerate(steps):
                outs[i].append(step.attend(layer, q, k, v))
    return outs


def session(caches, cfg=CFG, passes=6):
    """Prefill across the resident boundary, then verify passes with prefetch and rollback, host
    reads (kv_range, chunk scores, gathers): everything the engine asks of a full cache."""
    full, off = caches
    for a, b in zip(*feed(caches, 40, seed=0, cfg=cfg)):
        assert torch.allclose(a, b, atol=1e-12)
    for a, b in zip(*feed(caches, 24, seed=99, cfg=cfg, group=8)):  # a second prompt over host KV
        assert torch.allclose(a, b, atol=1e-12), "grouped prefill differs (NaN: a copy read before its wait)"
    for seed in range(1, passes):
        off.prepare_verify()
        for a, b in zip(*feed(caches, 5, seed=seed, cfg=cfg)):
            assert torch.allclose(a, b, atol=1e-12), "offloaded attention differs (NaN: a copy read before its wait)"
        full.rollback(full.length - 2)
        off.rollback(off.length - 2)
    assert torch.equal(full.kv_range(5, full.length)[0], off.kv_range(5, off.length)[0])
    query = torch.randn(1, 4, cfg.head_dim, dtype=torch.float64, device="cpu")
    assert torch.allclose(full.chunk_scores(1, query, 8), off.chunk_scores(1, query, 8), atol=1e-10)
    index = torch.arange(0, 48, 3, device="cpu").view(1, 1, -1).expand(1, 2, -1).contiguous()
    out_full = [torch.empty(1, 2, 16, cfg.head_dim, dtype=torch.float64, device="cpu") for _ in range(2)]
    out_off = [torch.empty_like(t) for t in out_full]
    full.gather_into(2, index, *out_full)
    off.gather_into(2, index, *out_off)
    assert all(torch.equal(a, b) for a, b in zip(out_full, out_off))


def offloaded(cfg=CFG, overlap=True, pin=True, decode_resident=0):
    return OffloadedKVCache(cfg, 96, 8, 8, dtype=torch.float64, device="cpu", overlap=overlap, pin=pin,
                            decode_resident_tokens=decode_resident)


@pytest.mark.parametrize("cfg", [CFG, WINDOWED], ids=["full-attention", "sliding-window"])
def test_overlapped_schedule_is_ordered_and_equals_resident(checked, cfg):
    caches = (ResidentKVCache(cfg, 96, dtype=torch.float64), offloaded(cfg))
    assert caches[1].store.pinned
    session(caches, cfg)
    stats = caches[1].prefetcher.stats
    assert stats.hits > 0 and checked.copies > 0 and checked.checked_accesses > checked.copies


def test_blocks_moved_after_prefill_are_ordered(checked):
    """The copies that move host blocks to the device after a prefill wait for its writes."""
    caches = (ResidentKVCache(CFG, 96, dtype=torch.float64), offloaded(decode_resident=32))
    session(caches)
    assert caches[1].ext_tokens == 24


def test_plain_schedule_equals_overlapped(checked):
    session((ResidentKVCache(CFG, 96, dtype=torch.float64), offloaded(overlap=False)))


def test_planted_bug_missing_ready_wait_is_caught(checked, monkeypatch):
    monkeypatch.setattr(Prefetcher, "_wait_ready", lambda self, slot: None)
    with pytest.raises(StreamOrderError, match="read of device memory on the compute stream"):
        session((ResidentKVCache(CFG, 96, dtype=torch.float64), offloaded()))


def test_planted_bug_missing_free_wait_is_caught(checked, monkeypatch):
    def issue_without_free_wait(self, layer, block, tokens, avoid):
        slot = next(s for s in range(len(self.staging_buf)) if s != avoid)
        source = self.store.block(layer, block)[:tokens]
        with self.streams.on(self.copy_stream):
            self.streams.copy(self.staging_buf[slot][:tokens], source)
            self.streams.record(self._ready[slot], self.copy_stream)
        self._account(slot, layer, block, source)
        return slot

    monkeypatch.setattr(Prefetcher, "_issue", issue_without_free_wait)
    with pytest.raises(StreamOrderError, match="write of device memory on the copy stream"):
        session((ResidentKVCache(CFG, 96, dtype=torch.float64), offloaded()))


def test_planted_bug_host_read_without_synchronize_is_caught(checked, monkeypatch):
    monkeypatch.setattr(Prefetcher, "synchronize", lambda self: None)
    with pytest.raises(StreamOrderError, match="host thread"):
        session((ResidentKVCache(CFG, 96, dtype=torch.float64), offloaded()))


def test_pageable_host_store_breaks_copy_discipline(checked):
    with pytest.raises(CopyDisciplineError, match="no pinned host side"):
        session((ResidentKVCache(CFG, 96, dtype=torch.float64), offloaded(pin=False)))


def test_strided_host_write_breaks_copy_discipline(checked, monkeypatch):
    """The old block-major layout wrote new tokens into a strided slice of each block."""
    def strided_write(self, layer, start, k, v, copy=None):
        block = self.data[layer, 0].permute(2, 3, 1, 0, 4)[:, :, 0]  # [B, Hkv, tokens, D]: strided
        (copy or torch.Tensor.copy_)(block[:, :, :k.shape[2]], k)

    monkeypatch.setattr(HostKVStore, "write", strided_write)
    with pytest.raises(CopyDisciplineError, match="non-contiguous host view"):
        session((ResidentKVCache(CFG, 96, dtype=torch.float64), offloaded()))


def hybrid(cfg=CFG):
    return OffloadedKVCache(cfg, 96, 8, 8, dtype=torch.float64, device="cpu", hybrid=0.6)


@pytest.mark.parametrize("cfg", [CFG, WINDOWED], ids=["full-attention", "sliding-window"])
def test_hybrid_schedule_is_ordered_and_equals_resident(checked, cfg):
    """The CPU attends the oldest host blocks in place while the rest stream: the same results,
    and the CPU reads the host store only after the copy stream's earlier writes have landed."""
    caches = (ResidentKVCache(cfg, 96, dtype=torch.float64), hybrid(cfg))
    session(caches, cfg)
    assert caches[1].cpu_bytes > 0 and checked.copies > 0


def test_planted_bug_hybrid_read_before_the_writes_land_is_caught(checked, monkeypatch):
    """The CPU's share read without waiting for the last pass's writes to the host store."""
    from triforce.cache.offloaded import OffloadedKVCache as Cache

    real = Cache.host_share
    monkeypatch.setattr(Cache, "host_share", lambda self, layer, q, blocks, start, first:
                        real(self, layer, q, blocks, start, False))
    with pytest.raises(StreamOrderError, match="host thread"):
        session((ResidentKVCache(CFG, 96, dtype=torch.float64), hybrid()))


def test_memory_freed_and_handed_out_again_starts_without_history(checked):
    """Two runs in one process: a buffer the first read on a copy stream is freed, and the next
    tensor at its address is written on the compute stream. CUDA's allocator orders that reuse
    (record_stream); the checker once kept the dead buffer's history (a flaky CI failure)."""
    from triforce.pinned import allocate_host

    source = allocate_host([(64,)], torch.float32)[0]
    memory = bytearray(256)  # outlives the tensors: the next one lands on the same address
    first = torch.frombuffer(memory, dtype=torch.float32)
    address = first.data_ptr()
    copy = checked.stream()
    with checked.on(copy):
        checked.copy(first, source)
        first.sum()  # read on the copy stream, never waited for by the compute stream
    with pytest.raises(StreamOrderError, match="not ordered after the .* on the copy stream"):
        first.add_(1)  # while it lives, the hazard is reported
    del first
    second = torch.frombuffer(memory, dtype=torch.float32)
    assert second.data_ptr() == address
    second.add_(1)  # new memory: no history, no error
    assert checked.checked_accesses > 0


def test_a_grouped_prefill_stages_every_layer_in_one_buffer_and_waits_to_reuse_it(pinning, monkeypatch):
    """Issue 73: the host-bound KV of a layer-major prefill is staged in one buffer made once per
    pass (it was one per layer); each layer overwrites it only after the last layer's copy home
    has read it, which the checker follows from its allocation (follow_all)."""
    import sys

    from checked_streams import CheckedStreams
    from triforce.offload import prefetcher

    fake = CheckedStreams(follow_all=True)
    monkeypatch.setattr(prefetcher, "streams_for", lambda device: fake)
    caches = (ResidentKVCache(CFG, 96, dtype=torch.float64), offloaded(CFG))
    made = []
    empty = torch.empty

    def counted(*args, **kwargs):
        if sys._getframe(1).f_code.co_name == "_stage":
            made.append(args[0])
        return empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", counted)
    with fake.watching():
        feed(caches, 40, seed=0)
        for a, b in zip(*feed(caches, 24, seed=99, group=8)):
            assert torch.allclose(a, b, atol=1e-12)
    assert len(made) == 1, made  # one [2, B, Hkv, tokens, D] for the 3 layers' k and v
