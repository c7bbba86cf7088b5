"""Both full caches implement the whole FullCache contract (the offloaded one once lacked keys(),
so top-k selection over it raised AttributeError), and every cache's per-pass view is a CacheStep."""
import pytest
import torch

from triforce.cache.resident import ResidentKVCache
from triforce.cache.sparse import SelectionPolicy, SparseKVCache
from triforce.cache.streaming import StreamingKVCache
from triforce.cache_contract import CacheStep, FullCache
from triforce.model.architectures import arch_config
from triforce.cache.offloaded import OffloadedKVCache

CFG = arch_config("tiny-test")


def contract_members() -> set[str]:
    names = set(FullCache.__annotations__)
    names |= {n for n, v in vars(FullCache).items() if not n.startswith("_") and (callable(v) or isinstance(v, property))}
    return names


def full_caches():
    return [ResidentKVCache(CFG, 64), OffloadedKVCache(CFG, 64, 16, 8, dtype=torch.float32, device="cpu", pin=False)]


@pytest.mark.parametrize("cache", full_caches(), ids=lambda c: type(c).__name__)
def test_every_full_cache_implements_the_whole_contract(cache):
    assert contract_members() >= {"step", "rollback", "chunk_scores", "gather_into", "kv_range", "keys", "prepare_verify"}
    missing = [name for name in contract_members() if not hasattr(cache, name)]
    assert not missing and isinstance(cache, FullCache)
    assert isinstance(cache.step(3, record_queries=True), CacheStep)


def test_sparse_and_streaming_steps_are_cache_steps():
    sparse = SparseKVCache(CFG, SelectionPolicy("streaming", 16, 4, 4), 8)
    streaming = StreamingKVCache(CFG, None, 4, 8, 4)  # the rope is only used when the window slides
    assert isinstance(sparse.step(2), CacheStep) and isinstance(streaming.step(2), CacheStep)


def test_a_step_refuses_more_queries_than_it_reserved():
    cache = ResidentKVCache(CFG, 64)
    step = cache.step(2)
    q = torch.zeros(1, CFG.num_heads, 3, CFG.head_dim)
    kv = torch.zeros(1, CFG.num_kv_heads, 3, CFG.head_dim)
    with pytest.raises(ValueError, match="attended past"):
        step.attend(0, q, kv, kv)
