"""The byte counts that follow from a model's shape (per GPU, for the rank with the largest share
under tensor parallelism). The planner takes the core's own configuration types: a ModelConfig
(loaded, or a named architecture's shapes) and SpecParams."""
from __future__ import annotations

from triforce.config import ModelConfig


def largest_share(n: int, tp: int) -> int:
    return -(-n // tp)


def kv_heads_share(m: ModelConfig, tp: int) -> int:
    return largest_share(m.num_kv_heads, tp)


def activation_bytes_per_token(m: ModelConfig, dtype_bytes: int, tp: int = 1) -> int:
    """The live activations of one token in one layer's forward on one rank."""
    heads = kv_heads_share(m, tp) * (m.num_heads // m.num_kv_heads)
    return (6 * m.hidden_size + 2 * heads * m.head_dim + 3 * largest_share(m.intermediate_size, tp)) * dtype_bytes


def weight_bytes(m: ModelConfig, dtype_bytes: int, tp: int = 1) -> int:
    """Parameter bytes on the rank with the largest share: attention split by whole KV heads
    (query heads follow their KV head), MLP by intermediate rows; embeddings, LM head and norms
    replicated."""
    kvh = kv_heads_share(m, tp)
    qh = kvh * (m.num_heads // m.num_kv_heads)
    inter = largest_share(m.intermediate_size, tp)
    h, d = m.hidden_size, m.head_dim
    attn = h * qh * d + 2 * h * kvh * d + qh * d * h
    attn += (qh * d + 2 * kvh * d) * m.qkv_bias + h * m.o_bias
    mlp = 3 * h * inter + (2 * inter + h) * m.mlp_bias
    per_layer = attn + mlp + 2 * h
    replicated = m.vocab_size * h * (1 if m.tie_word_embeddings else 2) + h
    return (m.num_layers * per_layer + replicated) * dtype_bytes


def kv_bytes_per_token_layer(m: ModelConfig, dtype_bytes: int, tp: int = 1) -> int:
    """K and V of one token in one layer, on the rank with the most KV heads."""
    return 2 * kv_heads_share(m, tp) * m.head_dim * dtype_bytes
