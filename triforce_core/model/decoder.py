"""A compact Llama-family decoder (Llama 2/3/3.1, Mistral, Qwen2).

`forward(tokens, positions, cache_view) -> logits`. The model computes queries, keys and values;
the cache view stores the keys and values and returns attention over whatever it holds, so the
same math serves the full cache, sparse caches and offloaded caches. No placement logic here.
Parameter names follow transformers' so checkpoints load without renaming.
"""
from __future__ import annotations

from typing import Callable, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from triforce.config import ModelConfig
from triforce.model.rope import RotaryEmbedding, apply_rope


class CacheView(Protocol):
    """One forward pass's access to a KV cache."""

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Store the new k, v ([B, Hkv, T, D], after RoPE) of `layer` and return the attention
        output [B, H, T, D] of q ([B, H, T, D]) over the cached keys plus the new ones."""


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in at least float32, as transformers does, but never below the input precision.
        calc = x.to(torch.float64 if x.dtype == torch.float64 else torch.float32)
        calc = calc * torch.rsqrt(calc.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * calc.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=cfg.o_bias)

    def forward(self, x, cos, sin, layer: int, cache_view: CacheView) -> torch.Tensor:
        batch, length, _ = x.shape
        q = self.q_proj(x).view(batch, length, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, length, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, length, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = cache_view.attend(layer, q, k, v)  # [B, H, T, D]
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, layer: int, cache_view: CacheView):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, layer, cache_view)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, rope: RotaryEmbedding):
        super().__init__()
        self.config = cfg
        self.rope = rope
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def tie_weights(self):
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache_view: CacheView,
                num_logits: int | None = None) -> torch.Tensor:
        """tokens, positions: [B, T] int64. Returns logits [B, T', V] for the last T' = num_logits
        positions (all T when None)."""
        x = self.model.embed_tokens(tokens)
        cos, sin = self.rope.cos_sin(positions, x.dtype)
        for index, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, index, cache_view)
        if num_logits is not None:
            x = x[:, -num_logits:]
        return self.lm_head(self.model.norm(x))

    @torch.inference_mode()
    def forward_layer_major(self, tokens: torch.Tensor, positions: torch.Tensor, cache_view: CacheView,
                            chunk_tokens: int, num_logits: int = 1,
                            on_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        """The same logits as forward, computed one layer at a time over all tokens (in chunks of
        `chunk_tokens`, in order), so a cache can finish each layer's KV before the next layer
        starts. on_layer(i) runs after layer i."""
        x = self.model.embed_tokens(tokens)
        cos, sin = self.rope.cos_sin(positions, x.dtype)
        length = tokens.shape[1]
        for index, layer in enumerate(self.model.layers):
            for start in range(0, length, chunk_tokens):
                end = min(length, start + chunk_tokens)
                x[:, start:end] = layer(x[:, start:end], cos[:, :, start:end], sin[:, :, start:end], index,
                                        cache_view)
            if on_layer is not None:
                on_layer(index)
        return self.lm_head(self.model.norm(x[:, -num_logits:]))
