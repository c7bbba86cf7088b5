"""The numba halves of a decoder layer (triforce.kernels.cpu.layer) against the eager layer they
replace for decoding steps on the CPU, their batch invariance, and when they serve a pass."""
import pytest
import torch

from triforce.kernels.cpu.linear import dense as cpu_linear
from triforce.kernels.cpu.layer import CpuLayer
from triforce.kernels.cpu.linear.dense import SMALL_ROWS
from triforce.model.loading import load_model

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2 ** -7}  # float32: sums' order; bf16: one ulp


@pytest.fixture
def kernel_model(tiny_model_dir, monkeypatch):
    """load(family, dtype): a tiny model whose projections take the small-rows kernels."""
    monkeypatch.setattr(cpu_linear, "MIN_WEIGHTS", 1)  # tiny matrices too

    def load(family: str, dtype: str):
        return load_model(str(tiny_model_dir(family)), dtype=dtype, device="cpu")
    return load


def _inputs(lm, length: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, length, lm.config.hidden_size, generator=g).to(lm.dtype)
    positions = torch.arange(40, 40 + length)[None]
    cos, sin = lm.model.layer_ropes[0].cos_sin(positions, lm.dtype)
    attn = torch.randn(1, lm.config.num_heads, length, lm.config.head_dim, generator=g).to(lm.dtype)
    return x, cos, sin, attn


def _eager(layer, x, cos, sin, attn):
    """What DecoderLayer.forward computes around attention without the numba halves."""
    q, k, v = layer.self_attn.project(layer.input_layernorm(x), cos, sin)
    x1 = x + layer.self_attn.output(attn)
    return (q, k, v), x1 + layer.mlp(layer.post_attention_layernorm(x1))


def _close(actual, expected, dtype):
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(actual.double(), expected.double(), rtol=tol,
                               atol=tol * expected.abs().max().item())


@pytest.mark.parametrize("family", ["llama-gqa", "qwen2", "llama3-rope"])  # qwen2: q/k/v biases
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("length", [1, 5, SMALL_ROWS])
def test_halves_match_the_eager_layer(kernel_model, family, dtype, length):
    lm = kernel_model(family, dtype)
    layer = lm.model.model.layers[1]
    assert layer.cpu_layer is not None
    x, cos, sin, attn = _inputs(lm, length)
    assert layer.cpu_layer.takes(x)
    (q, k, v), out = _eager(layer, x, cos, sin, attn)
    ours_q, ours_k, ours_v = layer.cpu_layer.pre(x, cos, sin)
    for ours, theirs in ((ours_q, q), (ours_k, k), (ours_v, v)):
        assert ours.shape == theirs.shape and ours.dtype == theirs.dtype
        _close(ours, theirs, lm.dtype)
    ours_out = layer.cpu_layer.post(x, attn)
    assert ours_out.shape == x.shape and ours_out.dtype == x.dtype
    _close(ours_out, out, lm.dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_row_gets_the_same_bits_alone_or_among_others(kernel_model, dtype):
    """A verify pass computes each token as decoding it alone would (greedy speculation = AR)."""
    lm = kernel_model("qwen2", dtype)
    cpu = lm.model.model.layers[0].cpu_layer
    x, cos, sin, attn = _inputs(lm, SMALL_ROWS, seed=3)
    together = cpu.pre(x, cos, sin), cpu.post(x, attn)
    for t in range(SMALL_ROWS):
        one = slice(t, t + 1)
        alone = cpu.pre(x[:, one], cos[:, :, one], sin[:, :, one]), cpu.post(x[:, one], attn[:, :, one])
        for a, b in zip(alone[0], together[0]):
            assert torch.equal(a[:, :, 0], b[:, :, t]), f"row {t}: q/k/v differ"
        assert torch.equal(alone[1][:, 0], together[1][:, t]), f"row {t}: the layer's output differs"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_batch_of_sequences_gets_each_sequences_own_bits(kernel_model, dtype):
    """A batch's rows (triforce.decoding.lockstep) at their own positions: each sequence's
    q, k, v and output are those of a call with that sequence alone."""
    lm = kernel_model("llama3-rope", dtype)
    cpu = lm.model.model.layers[1].cpu_layer
    length, batch = 3, 4
    g = torch.Generator().manual_seed(5)
    x = torch.randn(batch, length, lm.config.hidden_size, generator=g).to(lm.dtype)
    positions = torch.stack([torch.arange(start, start + length) for start in (0, 17, 40, 9)])
    cos, sin = lm.model.layer_ropes[0].cos_sin(positions, lm.dtype)
    attn = torch.randn(batch, lm.config.num_heads, length, lm.config.head_dim, generator=g).to(lm.dtype)
    together_qkv, together_out = cpu.pre(x, cos, sin), cpu.post(x, attn)
    for row in range(batch):
        alone_qkv = cpu.pre(x[row:row + 1].contiguous(), cos[row:row + 1], sin[row:row + 1])
        for together, alone in zip(together_qkv, alone_qkv):
            assert torch.equal(together[row:row + 1], alone)
        assert torch.equal(together_out[row:row + 1], cpu.post(x[row:row + 1].contiguous(), attn[row:row + 1]))


def test_which_passes_and_models_it_serves(kernel_model, tiny_model_dir, monkeypatch):
    lm = kernel_model("llama-gqa", "float32")
    layer = lm.model.model.layers[0]
    x = torch.zeros(1, SMALL_ROWS + 1, lm.config.hidden_size)
    assert layer.cpu_layer.takes(x[:, :SMALL_ROWS]) and not layer.cpu_layer.takes(x)  # prefill: eager
    assert not layer.cpu_layer.takes(x[:, :2].to(torch.float64))
    assert layer.cpu_layer.takes(torch.zeros(4, SMALL_ROWS // 4, lm.config.hidden_size))  # a batch's rows
    assert not layer.cpu_layer.takes(torch.zeros(2, SMALL_ROWS // 2 + 1, lm.config.hidden_size))
    lm.model.use_kernels("reference")
    assert layer.cpu_layer is None
    lm.model.use_kernels("fused")
    assert layer.cpu_layer is not None
    monkeypatch.setattr(cpu_linear, "MIN_WEIGHTS", 1 << 17)  # the real threshold: tiny matrices stay eager
    small = load_model(str(tiny_model_dir("llama-gqa")), dtype="float32", device="cpu")
    assert small.model.model.layers[0].cpu_layer is None
    assert not CpuLayer.fits(layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                             *small.model.model.layers[0].self_attn.fused, *small.model.model.layers[0].mlp.fused)


def test_the_default_model_decodes_through_them(default_lm):
    """The model users run takes the halves (the same tokens as the reference path are checked
    in test_cpu_linear); its float32 logits of one step match the eager layers'."""
    from triforce.config import SpecParams
    from triforce.decoding.engine import Engine

    layers = default_lm.model.model.layers
    assert all(layer.cpu_layer is not None for layer in layers)
    ids = default_lm.tokenizer("A long time ago, in a quiet village", add_special_tokens=False).input_ids
    engine = Engine(default_lm, SpecParams(method="ar"), len(ids) + 4)
    engine.set_sequence(ids)
    logits = {}
    kept = [layer.cpu_layer for layer in layers]
    try:
        for kind in ("halves", "eager"):
            step = engine.full.cache.step(1)
            logits[kind] = default_lm.model(torch.tensor([[ids[-1]]]), step.positions, step)
            engine.full.cache.rollback(step.start)
            for layer in layers:
                layer.cpu_layer = None
    finally:
        for layer, cpu in zip(layers, kept):
            layer.cpu_layer = cpu
    torch.testing.assert_close(logits["halves"], logits["eager"], rtol=1e-4, atol=1e-4)


class AttendOnly:
    """A pass's view that offers only the protocol's attend (as the tiers' wrapping views do)."""

    def __init__(self, step):
        self.step, self.positions = step, step.positions

    def attend(self, layer, q, k, v):
        return self.step.attend(layer, q, k, v)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("tokens", [1, 5])
def test_steps_straight_into_the_cache_give_the_bits_of_pre_attend_and_post(tiny_model_dir, monkeypatch, dtype,
                                                                            tokens):
    """CpuLayer.decode writes a step's keys and values into the cache's blocks and attends there
    (BufferStep.kernel_slots) with no torch tensor between the kernels: the logits and both
    caches' buffers equal those of pre, the cache's attend and post, step after step."""
    from triforce.cache.resident import ResidentKVCache
    from triforce.kernels.cpu.attention.buffers import BufferDecoder

    monkeypatch.setattr(cpu_linear, "MIN_WEIGHTS", 1)
    # 2 KV heads of 64: wide enough for the cache's CPU kernel (decode.MIN_KV_WIDTH)
    lm = load_model(str(tiny_model_dir("llama-gqa", hidden_size=256)), dtype=dtype, device="cpu")
    assert all(layer.cpu_layer is not None for layer in lm.model.model.layers)
    straight = []
    rows = BufferDecoder.attend_rows
    monkeypatch.setattr(BufferDecoder, "attend_rows", lambda self, *a: straight.append(a) or rows(self, *a))
    caches = [ResidentKVCache(lm.config, 64, dtype=lm.dtype, attn=lm.attn) for _ in range(2)]
    g = torch.Generator().manual_seed(7)
    start = 0
    for turn, count in enumerate((20, tokens, tokens, tokens)):  # a prefill (the eager layers), then steps
        ids = torch.randint(0, lm.config.vocab_size, (1, count), generator=g)
        positions = torch.arange(start, start + count)[None]
        steps = [cache.step(count, record_queries=turn == 2) for cache in caches]  # a verify for the sparse tiers
        logits = [lm.model(ids, positions, view) for view in (steps[0], AttendOnly(steps[1]))]
        assert torch.equal(logits[0], logits[1])
        if turn == 2:
            assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(steps[0].queries, steps[1].queries))
        start += count
    assert len(straight) == 3 * lm.config.num_layers  # every step's every layer, none of the prefill's
    for buffers in ("k_buf", "v_buf"):
        assert torch.equal(getattr(caches[0], buffers), getattr(caches[1], buffers))
