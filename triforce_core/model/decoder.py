"""A compact Llama-family decoder (Llama 2/3/3.1, Mistral, Qwen2, Qwen3, Phi-3/4, Gemma 3).

`forward(tokens, positions, cache_view) -> logits`. The model computes queries, keys and values;
the cache view stores the keys and values and returns attention over whatever it holds, so the
same math serves the full cache, sparse caches and offloaded caches. No placement logic here.
Parameter names follow transformers' so checkpoints load without renaming.

Two ways to run the projections (`CausalLM.use_kernels`): "reference", one nn.Linear per
checkpoint matrix (transformers' math, what the tests compare with), and "fused" (the default
once loaded): q/k/v and gate/up as one matrix each, through triforce.kernels.cpu.linear.dense, whose
small-rows kernels read the weights at the memory limit on a CPU. Fusing concatenates the
checkpoint matrices and re-points the nn.Linear weights at row slices of the result (the
separate matrices are freed), so both ways share one copy of the weights. While fused, a layer
whose projections all take the kernels also runs its work around attention for decoding steps
and verify passes (<= 16 tokens of one sequence) as two numba calls (triforce.kernels.cpu.layer):
eager PyTorch spent more time in its ~50 small operators per layer than in the weights. The fused operators
hold the tensors they were made from: a model whose parameters are moved or replaced afterwards
must call use_kernels("fused") again (tensor-parallel sharding does).

There is one loop over the layers. A long pass may bound its activations: with `chunk_tokens`
each layer runs its projections and MLP on pieces of that many tokens, and with `group_tokens`
the cache view is asked for attention once per group of that many queries (in order), so an
offloaded cache streams its host KV once per group rather than once per chunk. Prefill of an
offloaded cache is one such pass over the whole prompt: layer-major, each layer finished (and
its KV sent home) before the next starts.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from triforce.cache_contract import CacheView
from triforce.config.model import ModelConfig
from triforce.kernels.cpu.layer import CpuLayer
from triforce.kernels.cpu.linear.dense import FusedLinear
from triforce.kernels.cpu.linear.blocks import QuantLinear
from triforce.model.quantized_layers import (JoinedOutputs, QuantizedLinear, block_linear, one_block_format,
                                             stacked_blocks)
from triforce.model.rope import RotaryEmbedding, apply_rope

ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in at least float32, as transformers does, but never below the input precision.
        # F.rms_norm is x * rsqrt(mean(x^2) + eps), the same bits, in one call instead of five
        # (tiny models spend their time in calls; the CPU's decode kernels do their own norms).
        calc = x.to(torch.float64 if x.dtype == torch.float64 else torch.float32)
        return self.weight * F.rms_norm(calc, (calc.shape[-1],), eps=self.eps).to(x.dtype)


class GemmaRMSNorm(RMSNorm):
    """Gemma's: scales by 1 + weight (stored as zeros for identity), in float32 before the cast."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        calc = x.to(torch.float64 if x.dtype == torch.float64 else torch.float32)
        normed = F.rms_norm(calc, (calc.shape[-1],), eps=self.eps)
        return (normed * (1.0 + self.weight.to(calc.dtype))).to(x.dtype)


def make_norm(cfg: ModelConfig, size: int) -> RMSNorm:
    return (GemmaRMSNorm if cfg.gemma_norms else RMSNorm)(size, cfg.rms_norm_eps)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=cfg.o_bias)
        if cfg.qk_norm:  # Qwen3, Gemma 3
            self.q_norm = make_norm(cfg, cfg.head_dim)
            self.k_norm = make_norm(cfg, cfg.head_dim)
        self.qk_norm = cfg.qk_norm
        # the caches scale scores by 1/sqrt(head_dim); a model that scales otherwise scales its queries
        self.query_factor = None if cfg.query_scale is None else cfg.query_scale * cfg.head_dim ** 0.5
        self.whole_heads_turned = cfg.rotary_dim is None  # the numba layer turns whole heads only
        self.fused: tuple | None = None  # (qkv, o) while fused

    def fuse(self, on: bool) -> None:
        self.fused = (_concat_rows(self.q_proj, self.k_proj, self.v_proj), _single(self.o_proj)) if on else None

    def project(self, x, cos, sin) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, T, hidden] -> q [B, H, T, D], k, v [B, Hkv, T, D], after RoPE."""
        batch, length, _ = x.shape
        if self.fused is not None:
            q, k, v = self.fused[0](x).split([self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim,
                                              self.num_kv_heads * self.head_dim], dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(batch, length, self.num_heads, self.head_dim)
        k = k.view(batch, length, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.query_factor is not None:
            q = q * self.query_factor
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = v.view(batch, length, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def output(self, out: torch.Tensor) -> torch.Tensor:
        """Attention output [B, H, T, D] -> [B, T, hidden]."""
        batch, _, length, _ = out.shape
        o_proj = self.o_proj if self.fused is None else self.fused[1]
        return o_proj(out.transpose(1, 2).reshape(batch, length, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.act = ACTIVATIONS[cfg.activation]
        self.fused: tuple | None = None  # (gate_up, down) while fused

    def fuse(self, on: bool) -> None:
        self.fused = (_concat_rows(self.gate_proj, self.up_proj), _single(self.down_proj)) if on else None

    def forward(self, x):
        if self.fused is None:
            return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))
        gate, up = self.fused[0](x).chunk(2, dim=-1)
        return self.fused[1](self.act(gate) * up)


def _single(module: nn.Module):
    """A plain nn.Linear (or a block-quantized one) through the kernels; any other module (a
    tensor-parallel one that sums across ranks) stays as it is."""
    if isinstance(module, QuantizedLinear):
        return block_linear(module.block, module.bias)
    return FusedLinear(module.weight, module.bias) if type(module) is nn.Linear else module


def _concat_rows(*linears: nn.Linear):
    """One matrix holding the linears' weights one above the other; each linear's weight (and
    bias) becomes a view of its rows, so the checkpoint matrices are not kept twice. Made anew on
    each call (a model cut for tensor parallelism fuses its own share)."""
    if any(isinstance(m, QuantizedLinear) for m in linears):
        return stacked_blocks(linears) if one_block_format(linears) else JoinedOutputs([_single(m) for m in linears])
    fused_w = torch.cat([m.weight.detach() for m in linears])
    biases = [m.bias for m in linears]
    fused_b = None if biases[0] is None else torch.cat([b.detach() for b in biases])
    row = 0
    for m in linears:
        rows = m.weight.shape[0]
        m.weight = nn.Parameter(fused_w[row:row + rows], requires_grad=False)
        if fused_b is not None:
            m.bias = nn.Parameter(fused_b[row:row + rows], requires_grad=False)
        row += rows
    return FusedLinear(fused_w, fused_b)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = make_norm(cfg, cfg.hidden_size)
        self.post_attention_layernorm = make_norm(cfg, cfg.hidden_size)
        self.sandwich = cfg.gemma_norms  # Gemma: post_attention_layernorm norms the attention's output
        if self.sandwich:
            self.pre_feedforward_layernorm = make_norm(cfg, cfg.hidden_size)
            self.post_feedforward_layernorm = make_norm(cfg, cfg.hidden_size)
        self.cpu_layer: CpuLayer | None = None  # the numba halves, while fused and they fit

    def fuse(self, on: bool) -> None:
        self.self_attn.fuse(on)
        self.mlp.fuse(on)
        self.cpu_layer = None
        parts = (self.input_layernorm.weight, self.post_attention_layernorm.weight)
        # the numba halves hold no q/k norms and turn whole heads (Qwen3's, Gemma 3's and Phi-4-mini's
        # layers run eagerly), with SiLU and Llama's two norms
        fits = (not self.self_attn.qk_norm and self.self_attn.whole_heads_turned and self.mlp.act is F.silu
                and not self.sandwich)
        if on and fits and CpuLayer.fits(*parts, *self.self_attn.fused, *self.mlp.fused):
            attn = self.self_attn
            self.cpu_layer = CpuLayer(*parts, self.input_layernorm.eps, *attn.fused, *self.mlp.fused,
                                      attn.num_heads, attn.num_kv_heads, attn.head_dim)

    def forward(self, x, cos, sin, layer: int, cache_view: CacheView, chunk: int | None = None,
                group: int | None = None) -> torch.Tensor:
        """x [B, T, hidden] -> this layer's output. Without chunk and group (short passes): one
        attend call over all T tokens. Otherwise x is updated in place, group by group."""
        length = x.shape[1]
        if self.cpu_layer is not None and self.cpu_layer.takes(x):  # a decoding step on the CPU
            return self.cpu_layer.decode(x, cos, sin, layer, cache_view)
        if (chunk is None or chunk >= length) and (group is None or group >= length):
            return self.feed_forward(self.after_attention(x, cache_view.attend(layer, *self.self_attn.project(
                self.input_layernorm(x), cos, sin))))
        chunk = min(chunk or length, length)
        group = max(chunk, group or length) // chunk * chunk
        for g0 in range(0, length, group):
            pieces = [slice(s, min(length, s + chunk)) for s in range(g0, min(length, g0 + group), chunk)]
            qkv = [self.self_attn.project(self.input_layernorm(x[:, p]), cos[:, :, p], sin[:, :, p])
                   for p in pieces]
            q, k, v = (parts[0] if len(parts) == 1 else torch.cat(parts, dim=2) for parts in zip(*qkv))
            del qkv
            out = cache_view.attend(layer, q, k, v)  # the group's queries at once
            del q, k, v
            first = pieces[0].start
            for p in pieces:
                x[:, p] = self.feed_forward(self.after_attention(x[:, p], out[:, :, p.start - first:p.stop - first]))
        return x

    def after_attention(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The residual stream after attention's output [B, H, T, D] joins it."""
        out = self.self_attn.output(out)
        return x + (self.post_attention_layernorm(out) if self.sandwich else out)

    def feed_forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.sandwich:
            return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))
        return h + self.mlp(self.post_attention_layernorm(h))


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = make_norm(cfg, cfg.hidden_size)


class CausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, rope: RotaryEmbedding | tuple[RotaryEmbedding, ...]):
        """rope: the model's, or each layer's (triforce.model.rope.layer_ropes)."""
        super().__init__()
        self.config = cfg
        self.layer_ropes = rope if isinstance(rope, tuple) else (rope,) * cfg.num_layers
        self._embed_scales: dict[torch.dtype, float] = {}  # Gemma's sqrt(hidden), as each dtype rounds it
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def tie_weights(self):
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    _head: FusedLinear | QuantLinear | None = None  # the fused lm_head, present exactly while fused

    @property
    def kernels(self) -> str:
        return "reference" if self._head is None else "fused"

    def use_kernels(self, kind: str) -> None:
        """"fused" or "reference" projections (see the module's docstring); same tokens either way."""
        if kind not in ("fused", "reference"):
            raise ValueError(f"unknown kernels '{kind}' (fused or reference)")
        for layer in self.model.layers:
            layer.fuse(kind == "fused")
        # logits stay float32 (in a bfloat16 model too): rounding them makes ties of near-ties
        if kind != "fused":
            self._head = None
        elif isinstance(self.lm_head, QuantizedLinear):
            self._head = block_linear(self.lm_head.block, keep_float32=True)
        else:
            self._head = FusedLinear(self.lm_head.weight, keep_float32=True)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache_view: CacheView,
                num_logits: int | None = None, chunk_tokens: int | None = None,
                group_tokens: int | None = None) -> torch.Tensor:
        """tokens, positions: [B, T] int64. Returns logits [B, T', V] for the last T' = num_logits
        positions (all T when None). chunk_tokens, group_tokens: see the module's docstring."""
        x = self.model.embed_tokens(tokens)
        if self.config.embed_scale is not None:  # rounded to the weights' precision first, as transformers does
            if x.dtype not in self._embed_scales:
                self._embed_scales[x.dtype] = float(torch.tensor(self.config.embed_scale).to(x.dtype))
            x = x * self._embed_scales[x.dtype]
        angles: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # one (cos, sin) per distinct RoPE
        for index, layer in enumerate(self.model.layers):
            rope = self.layer_ropes[index]
            if id(rope) not in angles:
                angles[id(rope)] = rope.cos_sin(positions, x.dtype)
            x = layer(x, *angles[id(rope)], index, cache_view, chunk_tokens, group_tokens)
        if num_logits is not None:
            x = x[:, -num_logits:]
        return (self._head or self.lm_head)(self.model.norm(x))
