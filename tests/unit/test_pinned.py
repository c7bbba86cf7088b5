"""Pinned host memory: capacity checks, the block-major host KV store, and each numba kernel
against a plain torch reference."""
import pytest
import torch

from triforce.pinned import HostCapacityError, HostKVStore, allocate_host, gather_blocked
from triforce.pinned import host_memory

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]


def make_store(dtype=torch.float64, capacity=37, block=8, first=16):
    store = HostKVStore(num_layers=2, kv_heads=2, head_dim=4, capacity=capacity, block_tokens=block,
                        first_position=first, dtype=dtype, pin=False)
    g = torch.Generator().manual_seed(0)
    k = torch.randn(2, 1, 2, capacity, 4, generator=g).to(dtype)
    v = torch.randn(2, 1, 2, capacity, 4, generator=g).to(dtype)
    for layer in range(2):
        store.write(layer, first, k[layer], v[layer])
    return store, k, v


def test_store_write_read_and_blocks_round_trip():
    store, k, v = make_store()
    assert store.num_blocks == 5 and store.capacity == 40
    got_k, got_v = store.read(16 + 5, 16 + 30)
    assert torch.equal(got_k, k[:, :, :, 5:30]) and torch.equal(got_v, v[:, :, :, 5:30])
    block = store.block(1, 2)
    assert block.is_contiguous() and torch.equal(HostKVStore.block_kv(block, 8)[0], k[1, :, :, 16:24])
    assert store.block_start(2) == 32
    with pytest.raises(IndexError):
        store.read(10, 20)  # below the first host position


@pytest.mark.parametrize("dtype", DTYPES)
def test_numba_gather_matches_torch_reference(dtype):
    store, k, v = make_store(dtype)
    g = torch.Generator().manual_seed(1)
    index = torch.sort(torch.randint(0, 16 + 37, (1, 2, 12), generator=g), dim=-1).values
    out_k = torch.full((1, 2, 12, 4), 7.0, dtype=dtype)
    out_v = torch.full((1, 2, 12, 4), 7.0, dtype=dtype)
    gather_blocked(store.data[1], index, store.first_position, out_k, out_v)
    for h in range(2):
        for n in range(12):
            pos = int(index[0, h, n])
            if pos >= 16:  # held by the store
                assert torch.equal(out_k[0, h, n], k[1, 0, h, pos - 16])
                assert torch.equal(out_v[0, h, n], v[1, 0, h, pos - 16])
            else:          # resident positions are left for the device gather
                assert (out_k[0, h, n] == 7).all() and (out_v[0, h, n] == 7).all()


def test_allocation_over_the_budget_allocates_nothing():
    with pytest.raises(HostCapacityError, match="profile allows"):
        allocate_host([(1024,), (1 << 20,)], torch.float32, pin=False, budget_bytes=1 << 20)


def test_allocation_beyond_available_memory_is_refused(monkeypatch):
    monkeypatch.setattr(host_memory, "host_available_bytes", lambda: 3 << 30)
    with pytest.raises(HostCapacityError, match="only .* is available"):
        allocate_host([(1 << 30,)] * 3, torch.float32, pin=False)


def test_pinning_falls_back_to_pageable_without_cuda():
    (t,) = allocate_host([(16,)], torch.float32, pin=True)
    assert t.is_pinned() == torch.cuda.is_available()


def test_stores_borrow_one_arena_filled_once():
    from triforce.pinned import HostArena

    small = HostKVStore.bytes_for(2, 2, 4, 37, 8, torch.bfloat16)
    big = HostKVStore.bytes_for(3, 2, 4, 50, 16, torch.bfloat16)
    arena = HostArena(big, pin=False)
    first = HostKVStore(2, 2, 4, 37, 8, first_position=16, dtype=torch.bfloat16, arena=arena)
    assert first.nbytes == small and first.data.data_ptr() == arena.data.data_ptr()  # a view, nothing allocated
    arena.fill_random(first.nbytes, torch.bfloat16)
    assert arena.filled == small and bool(first.data.abs().sum() > 0) and not arena.data[small:].any()
    before = first.data.clone()
    arena.fill_random(small, torch.bfloat16)  # filled already: nothing is rewritten
    assert torch.equal(first.data, before)
    second = HostKVStore(3, 2, 4, 50, 16, first_position=0, dtype=torch.bfloat16, arena=arena)
    arena.fill_random(second.nbytes, torch.bfloat16)  # the rest only, in whole values
    assert arena.filled == big and torch.isfinite(second.data.float()).all() and second.data.flatten()[-1] != 0
    with pytest.raises(HostCapacityError, match="does not fit the shared one"):
        HostKVStore(3, 2, 4, 70, 16, first_position=0, dtype=torch.bfloat16, arena=arena)
