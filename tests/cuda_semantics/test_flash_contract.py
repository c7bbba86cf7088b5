"""What CUDA's flash kernel (aten._scaled_dot_product_flash_attention: FlashAttention-2 inside
PyTorch) demands of its inputs, asserted on every call of triforce's fused partial attention. On
a CPU the same call goes to the CPU twin, which also takes inputs CUDA refuses (a strided last
dimension, float32); on CUDA, SdpaAttention.partial would then give the fused path up for the
tiled reference with one note: slower, and silent in a test. So the real callers run here in
half precision with the contract checked, the offloaded cache's streamed blocks included."""
import pytest
import torch

from triforce.cache.resident import ResidentKVCache
from triforce.config.model import ModelConfig
from triforce.kernels import SDPA, attention
from triforce.kernels import partial as partial_module
from triforce.kernels.cpu.attention import decode as cpu_attention
from triforce.kernels.partial import partial_attention
from triforce.cache.offloaded import OffloadedKVCache

HALF = (torch.bfloat16, torch.float16)


def flash_contract_breaches(q, k, v, causal: bool) -> list[str]:
    """FlashAttention-2's forward checks (mha_fwd), in PyTorch's [B, H, S, D] layout."""
    breaches = []
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            return [f"{name} is {t.dim()}-D, not [B, H, S, D]"]
        if t.dtype not in HALF:
            breaches.append(f"{name} is {t.dtype}: only float16 and bfloat16")
        if t.stride(-1) != 1:
            breaches.append(f"{name}'s last dimension is not contiguous (stride {t.stride(-1)})")
    if not q.dtype == k.dtype == v.dtype:
        breaches.append(f"dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if not q.device == k.device == v.device:
        breaches.append("tensors on different devices")
    batch, heads, num_queries, dim = q.shape
    if k.shape != v.shape or k.shape[0] != batch or k.shape[3] != dim:
        breaches.append(f"k {tuple(k.shape)} and v {tuple(v.shape)} do not fit q {tuple(q.shape)}")
    if heads % k.shape[1]:
        breaches.append(f"{heads} query heads over {k.shape[1]} KV heads")
    if dim > 256 or dim % 8:
        breaches.append(f"head dim {dim}: at most 256 and a multiple of 8")
    if causal and num_queries != k.shape[2]:
        # FlashAttention-2 aligns a causal mask bottom-right, PyTorch's is_causal top-left
        breaches.append(f"causal with {num_queries} queries over {k.shape[2]} keys: alignment differs")
    return breaches


@pytest.fixture
def flash_calls(monkeypatch):
    """Every flash call of kernels/partial.py, checked against the CUDA contract before it runs."""
    calls = []
    real = partial_module._flash_call

    def checked(rows, k, v, scale, causal):
        breaches = flash_contract_breaches(rows, k, v, causal)
        assert not breaches, "; ".join(breaches)
        calls.append((tuple(rows.shape), tuple(k.shape), causal))
        return real(rows, k, v, scale, causal)

    monkeypatch.setattr(partial_module, "_flash_call", checked)
    monkeypatch.setattr(SDPA, "fused_partial_failed", None)
    # a card's chunks go to flash: the CPU's own prefill kernel (bfloat16 dot CPUs) never takes them
    monkeypatch.setattr(cpu_attention, "takes_prefill", lambda *args: False)
    return calls


def _staged(kv_heads: int, tokens: int, dim: int, dtype, g):
    """K and V as the offloaded cache hands them over: views of one token-major staging buffer."""
    staging = torch.randn(tokens, 2, 1, kv_heads, dim, generator=g, dtype=dtype)
    return staging[:, 0].permute(1, 2, 0, 3), staging[:, 1].permute(1, 2, 0, 3)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("heads,kv_heads,queries", [(8, 2, 7), (4, 4, 1), (8, 2, 40)])
def test_streamed_and_diagonal_blocks_meet_the_flash_contract(flash_calls, dtype, heads, kv_heads, queries):
    g = torch.Generator(device="cpu").manual_seed(0)
    q = torch.randn(1, heads, queries, 64, generator=g, dtype=dtype)
    old_k, old_v = _staged(kv_heads, 96, 64, dtype, g)
    own_k, own_v = _staged(kv_heads, 32 + queries, 64, dtype, g)
    blocks = [(old_k, old_v, 0), (own_k, own_v, 200 - 32)]  # keys before the queries; then ending with them
    for k, v, k_start in blocks:
        out, lse = SDPA.partial(q, k, v, scale=0.125, q_start=200, k_start=k_start)
        ref_out, ref_lse = partial_attention(q.double(), k.double(), v.double(), scale=0.125, q_start=200,
                                             k_start=k_start)
        assert float((out.double() - ref_out).norm() / ref_out.norm()) < 2e-2
        assert float((lse.double() - ref_lse).abs().max()) < 5e-2
    assert SDPA.fused_partial_failed is None
    causal = [c for c in flash_calls if c[2]]  # one query over keys ending with it sees them whole
    assert len(causal) < len(flash_calls) and bool(causal) == (queries > 1)


@pytest.mark.parametrize("dtype", HALF)
def test_a_later_prefill_chunk_meets_the_flash_contract(flash_calls, dtype):
    g = torch.Generator(device="cpu").manual_seed(1)
    q = torch.randn(1, 6, 24, 64, generator=g, dtype=dtype)
    k, v = (torch.randn(1, 2, 80, 64, generator=g, dtype=dtype) for _ in range(2))
    out = attention(q, k, v, scale=0.125)
    mask = torch.ones(24, 80, dtype=torch.bool).tril(80 - 24)
    ref = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double().repeat_interleave(3, 1),
                                                           v.double().repeat_interleave(3, 1), attn_mask=mask,
                                                           scale=0.125)
    assert flash_calls and float((out.double() - ref).norm() / ref.norm()) < 2e-2


@pytest.mark.parametrize("dtype", HALF)
def test_the_offloaded_cache_in_half_precision_meets_the_flash_contract(flash_calls, dtype):
    from transformers import LlamaConfig

    cfg = ModelConfig.from_hf(LlamaConfig(vocab_size=10, hidden_size=256, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2))
    full = ResidentKVCache(cfg, 512, dtype=dtype, device="cpu")
    off = OffloadedKVCache(cfg, 512, 64, 64, dtype=dtype, device="cpu", pin=False)
    g = torch.Generator(device="cpu").manual_seed(2)
    for num_new in (160, 6, 6):  # a prefill over the resident 64 and two host blocks, then two verify passes
        off.prepare_verify()
        steps = [full.step(num_new), off.step(num_new)]
        for layer in range(cfg.num_layers):
            q, k, v = (torch.randn(1, h, num_new, cfg.head_dim, generator=g, dtype=dtype) for h in (4, 2, 2))
            a, b = (s.attend(layer, q, k, v).double() for s in steps)
            assert float((a - b).norm() / a.norm()) < 2e-2
    assert SDPA.fused_partial_failed is None and len(flash_calls) > 3 * cfg.num_layers
