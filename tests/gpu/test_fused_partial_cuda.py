"""The fused partial-attention path on CUDA (PyTorch's flash kernel with the log-sum-exp) against
the tiled reference, and the offloaded cache in bfloat16 (which takes that path for streamed
blocks) against the resident cache, with real copy streams. Skipped without CUDA."""
import pytest
import torch
from transformers import LlamaConfig

from triforce.cache.resident import ResidentKVCache
from triforce.config.model import ModelConfig
from triforce.kernels import SDPA
from triforce.kernels.partial import partial_attention
from triforce.cache.offloaded import OffloadedKVCache

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("heads,kv_heads,queries", [(32, 8, 7), (32, 32, 1), (32, 8, 1024)])
def test_fused_partial_matches_the_reference_on_cuda(heads, kv_heads, queries):
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, heads, queries, 128, generator=g, device="cuda", dtype=torch.bfloat16)
    staging = torch.randn(512, 2, 1, kv_heads, 128, generator=g, device="cuda", dtype=torch.bfloat16)
    k, v = staging[:, 0].permute(1, 2, 0, 3), staging[:, 1].permute(1, 2, 0, 3)
    out, lse = SDPA.partial(q, k, v, scale=128 ** -0.5, q_start=4096, k_start=1024)
    ref_out, ref_lse = partial_attention(q.double(), k.double(), v.double(), scale=128 ** -0.5, q_start=4096,
                                         k_start=1024)
    assert SDPA.fused_partial_failed is None
    assert float((out.double() - ref_out).norm() / ref_out.norm()) < 1e-2
    assert float((lse.double() - ref_lse).abs().max()) < 2e-2


def test_offloaded_bf16_attention_matches_resident_on_cuda():
    cfg = ModelConfig.from_hf(LlamaConfig(vocab_size=10, hidden_size=256, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2))
    full = ResidentKVCache(cfg, 2048, dtype=torch.bfloat16, device="cuda")
    off = OffloadedKVCache(cfg, 2048, 256, 256, dtype=torch.bfloat16, device="cuda")
    assert off.store.pinned
    g = torch.Generator(device="cuda").manual_seed(1)
    for num_new in (1500, 6, 6):
        off.prepare_verify()
        steps = [full.step(num_new), off.step(num_new)]
        for layer in range(cfg.num_layers):
            q, k, v = (torch.randn(1, h, num_new, cfg.head_dim, generator=g, device="cuda", dtype=torch.bfloat16)
                       for h in (4, 2, 2))
            a, b = (s.attend(layer, q, k, v).double() for s in steps)
            assert float((a - b).norm() / a.norm()) < 2e-2
    assert off.prefetcher.stats.hits > 0


@pytest.mark.parametrize("heads,kv_heads,queries,head", [(32, 8, 512, 1024), (32, 32, 7, 0)])
def test_a_diagonal_block_takes_the_fused_kernel_on_cuda(heads, kv_heads, queries, head):
    """A pass's own new tokens (keys ending with the queries, causal) fuse on CUDA too: no float32
    tiled fallback in an offloaded prefill's causal blocks or a verify's new-token block."""
    from triforce.kernels.partial import fused_shape
    g = torch.Generator(device="cuda").manual_seed(2)
    keys = head + queries
    q = torch.randn(1, heads, queries, 128, generator=g, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, kv_heads, keys, 128, generator=g, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(1, kv_heads, keys, 128, generator=g, device="cuda", dtype=torch.bfloat16)
    assert fused_shape(q, keys, 5000 + head, 5000, None) == "diagonal"
    out, lse = SDPA.partial(q, k, v, scale=128 ** -0.5, q_start=5000 + head, k_start=5000)
    ref_out, ref_lse = partial_attention(q.double(), k.double(), v.double(), scale=128 ** -0.5,
                                         q_start=5000 + head, k_start=5000)
    assert SDPA.fused_partial_failed is None
    assert float((out.double() - ref_out).norm() / ref_out.norm()) < 1e-2
    assert float((lse.double() - ref_lse).abs().max()) < 2e-2


def test_bf16_head_gives_float32_logits_on_cuda():
    """The head's logits are float32 sums (mm with out_dtype), not bfloat16 results widened."""
    from triforce.kernels.cpu.linear.dense import FusedLinear
    g = torch.Generator(device="cuda").manual_seed(3)
    w = torch.randn(32000, 4096, generator=g, device="cuda", dtype=torch.bfloat16) * 0.02
    x = torch.randn(3, 4096, generator=g, device="cuda", dtype=torch.bfloat16)
    logits = FusedLinear(w, keep_float32=True)(x)
    ref = x.double() @ w.double().t()
    assert logits.dtype == torch.float32
    assert float((logits.double() - ref).abs().max()) < 1e-3  # bf16 rounding would be ~1e-2 at |logit| ~ 3
