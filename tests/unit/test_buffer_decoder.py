"""A cache's decoding steps on the CPU go straight over its buffers (BufferDecoder): the same
bits in the buffers and the same attention as the kernel's path through views, and every call
it does not take left to that path."""
import pytest
import torch

from triforce.cache.resident import ResidentKVCache
from triforce.config.model import ModelConfig
from triforce.kernels import SDPA, SdpaAttention, SdpaReference, attention


class ThroughViews(SdpaAttention):
    """The kernel's path through the cache's views (the one before BufferDecoder)."""

    def buffer_decoder(self, k_buf, v_buf, scale):
        return None


def _config(**overrides) -> ModelConfig:
    fields = dict(model_type="llama", vocab_size=32, hidden_size=576, intermediate_size=64, num_layers=2,
                  num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, max_position_embeddings=4096,
                  qkv_bias=False, o_bias=False, mlp_bias=False, tie_word_embeddings=True,
                  sliding_windows=(None, None))
    return ModelConfig(**{**fields, **overrides})


def _filled(cfg, dtype, attn, batch=1, prefix=700, seed=0):
    cache = ResidentKVCache(cfg, prefix + 40, batch=batch, dtype=dtype, attn=attn)
    g = torch.Generator().manual_seed(seed)
    step = cache.step(prefix)
    for layer in range(cfg.num_layers):
        kv = [torch.randn(batch, cfg.num_kv_heads, prefix, cfg.head_dim, generator=g).to(dtype) for _ in range(2)]
        step.write(layer, 0, *kv)
    return cache


def _new(cfg, dtype, tokens, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, cfg.num_heads, tokens, cfg.head_dim, generator=g).to(dtype)
    k, v = (torch.randn(1, cfg.num_kv_heads, tokens, cfg.head_dim, generator=g).to(dtype) for _ in range(2))
    return q, k, v


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 5])
def test_steps_over_the_buffers_equal_the_path_through_views(dtype, tokens):
    cfg = _config()
    fast, views = _filled(cfg, dtype, SDPA), _filled(cfg, dtype, ThroughViews())
    for turn in range(3):  # steps after steps: each sees the keys the last ones wrote
        steps = [cache.step(tokens, record_queries=True) for cache in (fast, views)]
        assert steps[0].decoder is not None and steps[1].decoder is None
        for layer in range(cfg.num_layers):
            q, k, v = _new(cfg, dtype, tokens, seed=10 * turn + layer)
            outs = [step.attend(layer, q, k, v) for step in steps]
            assert outs[0].dtype == dtype and outs[0].shape == q.shape
            assert torch.equal(outs[0], outs[1])
            assert steps[0].queries[layer] is q
    assert torch.equal(fast.k_buf, views.k_buf) and torch.equal(fast.v_buf, views.v_buf)


def test_a_binding_window_a_batch_and_the_reference_are_left_to_the_other_paths():
    windowed = _filled(_config(sliding_windows=(None, 256)), torch.float32, SDPA)
    step = windowed.step(1)
    q, k, v = _new(_config(), torch.float32, 1, seed=3)
    step.attend(0, q, k, v)  # no window on layer 0: the decoder's
    out = step.attend(1, q, k, v)  # layer 1 sees only the last 256 keys
    keys, values = windowed.k_buf[1, :, :, :step.end], windowed.v_buf[1, :, :, :step.end]
    expected = attention(q, keys, values, scale=64 ** -0.5, sliding_window=256, cpu_kernel=False)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert _filled(_config(), torch.float32, SDPA, batch=2).step(1).decoder is None
    assert _filled(_config(), torch.float32, SdpaReference()).step(1).decoder is None


def test_a_step_still_refuses_tokens_past_its_slots():
    cache = _filled(_config(), torch.float32, SDPA)
    step = cache.step(1)
    q, k, v = _new(_config(), torch.float32, 2, seed=4)
    with pytest.raises(ValueError, match="attended past the step's 1 new tokens"):
        step.attend(0, q, k, v)


def test_new_rows_in_another_dtype_are_left_to_the_torch_copy():
    """The decoder copies rows as they are (bfloat16 travels as bits): float32 values for a
    bfloat16 cache go through torch's copy, which rounds them, as before."""
    fast, views = _filled(_config(), torch.bfloat16, SDPA), _filled(_config(), torch.bfloat16, ThroughViews())
    q, k, v = _new(_config(), torch.bfloat16, 1, seed=5)
    wide = v.float() + 1e-3
    outs = [cache.step(1).attend(0, q, k, wide) for cache in (fast, views)]
    assert torch.equal(outs[0], outs[1]) and torch.equal(fast.v_buf, views.v_buf)
