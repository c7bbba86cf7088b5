"""Pinning is exact and a failed pin is said; on CUDA, SDPA is never asked for a mask together
with enable_gqa (older PyTorch had no fused CUDA kernel for that pair and fell back to the math
kernel and its [B, H, T, S] float32 scores)."""
import pytest
import torch
import torch.nn.functional as F

from fake_card import FakeCard
from triforce.kernels import attention
from triforce.pinned import HostKVStore, allocate_host, pinned_bytes
from triforce.pinned import host_memory


def test_pinning_registers_exactly_the_asked_bytes(pinning):
    before = pinned_bytes()
    (t,) = allocate_host([(3, 1000, 7)], torch.float32)  # 84000 bytes: no power-of-two rounding
    assert pinning.registered[-1] == (t.data_ptr(), 84000) and pinned_bytes() - before == 84000
    ptr = t.data_ptr()
    del t
    assert ptr in pinning.unregistered and pinned_bytes() == before


def test_pinned_memory_stays_pinned_while_a_view_of_it_lives(pinning):
    """Unregistered when the memory is freed, not when the tensor allocate_host returned is: a
    view (a block of the store, an arena's store) may outlive it, and copies from it must stay
    asynchronous (cudaHostUnregister under a pending copy is undefined)."""
    (t,) = allocate_host([(4, 1000)], torch.float32)
    ptr, block = t.data_ptr(), t[1].detach()  # no _base: nothing else keeps t alive
    del t
    assert host_memory.is_registered(block) and ptr not in pinning.unregistered
    del block
    assert ptr in pinning.unregistered and not any(p == ptr for p in host_memory._pinned)


def test_a_failed_pin_is_said_and_the_store_knows(monkeypatch, capsys):
    monkeypatch.setattr(host_memory, "can_pin", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", FakeCard(pin_fails=True).cudart)
    store = HostKVStore(2, 2, 8, 64, 16, first_position=0, dtype=torch.float32)
    assert not store.pinned
    err = capsys.readouterr().err
    assert "could not pin" in err and "will not overlap" in err


def test_pinning_is_checked_against_physical_ram(pinning, monkeypatch):
    monkeypatch.setattr(host_memory, "host_total_bytes", lambda: host_memory.HOST_SAFETY_BYTES + (1 << 20))
    with pytest.raises(host_memory.HostCapacityError, match="page-locked"):
        allocate_host([(1 << 20,)], torch.float32)


@pytest.mark.parametrize("queries,keys,window", [(7, 300, None), (64, 300, None), (1, 300, 100), (5, 300, 100)])
def test_sdpa_never_gets_a_mask_with_enable_gqa(monkeypatch, queries, keys, window):
    real = F.scaled_dot_product_attention
    calls = []

    def spy(*args, **kwargs):
        calls.append(kwargs)
        assert not (kwargs.get("attn_mask") is not None and kwargs.get("enable_gqa")), "mask with enable_gqa"
        return real(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    g = torch.Generator(device="cpu").manual_seed(0)
    q = torch.randn(1, 8, queries, 16, generator=g, device="cpu", dtype=torch.float64)
    k, v = (torch.randn(1, 2, keys, 16, generator=g, device="cpu", dtype=torch.float64) for _ in range(2))
    out = attention(q, k, v, scale=0.25, sliding_window=window, fold_masked_gqa=True)  # as on CUDA
    expanded = [t.repeat_interleave(4, 1) for t in (k, v)]
    mask = torch.ones(queries, keys, dtype=torch.bool, device="cpu").tril(keys - queries)
    if window is not None:
        mask &= ~torch.ones(queries, keys, dtype=torch.bool, device="cpu").tril(keys - queries - window)
    ref = real(q, *expanded, attn_mask=mask, scale=0.25)
    assert calls and torch.allclose(out, ref, atol=1e-12)
