"""The hybrid full verify: the CPU attends over the oldest share of each layer's host blocks in
place while the rest streams, and the partial results merge by log-sum-exp. Every method's greedy
tokens equal the fully resident run (float64) at every share, the streamed bytes shrink by the
CPU's share, and a planted bug in the split or in the merge is caught."""
import pytest
import torch

from triforce.config import SamplingParams
from triforce.decoding.engine import Engine
from triforce.kernels.cpu.attention import host as host_attention
from triforce.model.loading import load_model
from triforce.cache import offloaded
from triforce.offload.hybrid import HybridRates, split_blocks
from triforce.cache.offloaded import OffloadedKVCache
from test_offload import PROMPTS, spec_for

GREEDY = SamplingParams()


@pytest.fixture(scope="module")
def target(tiny_model_dir):
    return load_model(str(tiny_model_dir("llama-gqa", max_position_embeddings=512)), dtype="float64", device="cpu")


def decode(lm, method, ids, new_tokens, hybrid=None):
    cache = None
    if hybrid is not False:
        cache = OffloadedKVCache(lm.config, len(ids) + new_tokens, 16, 8, dtype=lm.dtype, device=lm.device,
                                 pin=False, hybrid=hybrid)
    engine = Engine(lm, spec_for(method), len(ids) + new_tokens, "lookup" if spec_for(method).uses_draft else None,
                    kv_cache=cache)
    engine.set_sequence(ids)
    return engine.generate(new_tokens, GREEDY), cache


@pytest.mark.parametrize("method,share", [("ar", 1.0), ("ar", 0.4), ("triforce", 0.7), ("retrieval", 0.7)])
def test_hybrid_tokens_equal_resident(target, method, share):
    ids = target.tokenizer(PROMPTS[0]).input_ids
    expected, _ = decode(target, method, ids, 24, hybrid=False)
    streamed, plain = decode(target, method, ids, 24, hybrid=None)
    got, cache = decode(target, method, ids, 24, hybrid=share)
    assert got.tokens == expected.tokens == streamed.tokens, (method, share)
    assert cache.cpu_bytes > 0 and plain.cpu_bytes == 0
    assert cache.prefetcher.stats.h2d_bytes < plain.prefetcher.stats.h2d_bytes  # fewer bytes streamed


def verify_logits(lm, hybrid):
    """The logits of a 5-token verify pass after a prompt whose KV is mostly on the host."""
    from triforce.decoding.full_tier import FullTier

    ids = lm.tokenizer(PROMPTS[1]).input_ids
    cache = None if hybrid is False else OffloadedKVCache(lm.config, len(ids) + 8, 16, 8, dtype=lm.dtype,
                                                          device=lm.device, pin=False, hybrid=hybrid)
    tier = FullTier(lm, len(ids) + 8, cache)
    tier.cover(ids[:-5])
    return tier.verify(ids)[0]


def test_verify_logits_equal_resident(target):
    assert torch.allclose(verify_logits(target, 0.7), verify_logits(target, False), atol=1e-10, rtol=0)


def test_a_block_the_split_drops_is_caught(target, monkeypatch):
    """A planted bug: the split loses the CPU's last block (neither streamed nor attended)."""
    def lossy(blocks, share):
        cpu, streamed = split_blocks(blocks, share)
        return cpu[:-1], streamed
    monkeypatch.setattr(offloaded, "split_blocks", lossy)
    assert not torch.allclose(verify_logits(target, 0.7), verify_logits(target, False), atol=1e-6)


def test_a_wrong_merge_weight_is_caught(target, monkeypatch):
    """A planted bug: the CPU's log-sum-exp is off by log 2 (its share weighed double)."""
    real = host_attention.host_partial

    def heavy(*args, **kw):
        out, lse = real(*args, **kw)
        return out, lse + 0.6931471805599453
    monkeypatch.setattr(offloaded, "host_partial", heavy)
    assert not torch.allclose(verify_logits(target, 0.7), verify_logits(target, False), atol=1e-6)


def test_the_split_keeps_the_newest_block_streamed_and_follows_the_rates():
    assert split_blocks((3, 4, 5, 6), 1.0) == ((3, 4, 5), (6,))
    assert split_blocks((3, 4, 5, 6), 0.5) == ((3, 4), (5, 6))
    assert split_blocks((7,), 0.9) == ((), (7,))
    rates = HybridRates(h2d_gbps=25, cpu_gbps=50, cpu_tflops=0.2, group=1, element_bytes=2)
    # one query row per head: memory-bound, the CPU takes 2/3; nine: arithmetic-bound, less
    assert rates.cpu_share(1) == pytest.approx(2 / 3)
    assert rates.cpu_rate_gbps(9) == pytest.approx(0.2 * 1000 / 4.5) and rates.cpu_share(9) < rates.cpu_share(1)
    assert rates.host_ms(75e9, 1) == pytest.approx(1000.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("fast", [True, False])
def test_host_partial_equals_softmax_over_the_blocks(dtype, fast, monkeypatch):
    if fast and not host_attention.HAS_F32_FMA:
        pytest.skip("no FMA on this CPU")
    monkeypatch.setattr(host_attention, "HAS_F32_FMA", fast)
    g = torch.Generator().manual_seed(3)
    data = torch.randn(6, 32, 2, 2, 2, 64, generator=g).to(dtype)  # [blocks, tokens, K/V, B, Hkv, D]
    q = torch.randn(2, 6, 3, 64, generator=g).to(dtype)
    blocks, counts = [0, 2, 5], [32, 32, 11]
    out, lse = host_attention.host_partial(q, data, blocks, counts, scale=0.125)
    keys = torch.cat([data[b, :c] for b, c in zip(blocks, counts)]).double()  # [S, 2, B, Hkv, D]
    k = keys[:, 0].permute(1, 2, 0, 3).repeat_interleave(3, 1)
    v = keys[:, 1].permute(1, 2, 0, 3).repeat_interleave(3, 1)
    scores = q.double() @ k.transpose(-1, -2) * 0.125
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    assert torch.allclose(out.double(), torch.softmax(scores, -1) @ v, atol=tol)
    assert torch.allclose(lse.double(), torch.logsumexp(scores, -1), atol=tol)
