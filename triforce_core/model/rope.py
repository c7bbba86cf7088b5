"""Rotary position embeddings. Inverse frequencies and attention scaling come from transformers'
rope utilities, so every scaling type (default, linear, dynamic, yarn, llama3, ...) matches it."""
from __future__ import annotations

import torch
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from triforce.config.model import layer_rope_parameters, rope_parameters
from triforce.errors import UserError


def _default_inv_freq(hf_config, params: dict) -> torch.Tensor:
    base = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    dim = int(dim * params.get("partial_rotary_factor", 1.0))
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim))


def _longrope(hf_config) -> tuple[torch.Tensor, float]:
    """Phi-3's LongRoPE: its long factors when the model's context passes the trained one, for every
    position of every pass. transformers switches per pass (a pass reaching past the trained
    context uses the long factors, an earlier one the short), which would give a cached key two
    meanings across passes and make a verify pass differ from decoding; a context chosen once
    (as llama.cpp chooses by the context it was given) keeps every method's tokens equal."""
    params = rope_parameters(hf_config)
    original = params.get("original_max_position_embeddings",
                          getattr(hf_config, "original_max_position_embeddings", None)) or hf_config.max_position_embeddings
    long = hf_config.max_position_embeddings > original
    return ROPE_INIT_FUNCTIONS["longrope"](hf_config, "cpu", seq_len=original + 1 if long else None)


def layer_ropes(hf_config, num_layers: int) -> tuple["RotaryEmbedding", ...]:
    """Each layer's RoPE: one object shared by every layer, or (Gemma 3) one per layer type,
    local layers with their own base and global ones with the model's scaling."""
    by_type = layer_rope_parameters(hf_config)
    if by_type is None:
        return (RotaryEmbedding(hf_config),) * num_layers
    ropes = {t: RotaryEmbedding(hf_config, layer_type=t) for t in sorted(by_type)}
    return tuple(ropes[t] for t in hf_config.layer_types)


class RotaryEmbedding:
    """Maps positions to (cos, sin). Pure function of positions; dynamic NTK scaling, as in
    transformers, widens the frequencies once a forward pass reaches past the original length.
    layer_type: which of a model's per-type parameter sets (Gemma 3's) this one computes."""

    def __init__(self, hf_config, layer_type: str | None = None):
        params = rope_parameters(hf_config) if layer_type is None else layer_rope_parameters(hf_config)[layer_type]
        self.rope_type = params.get("rope_type", params.get("type", "default"))
        self._hf_config = hf_config
        self._by_type = {} if layer_type is None else {"layer_type": layer_type}
        if self.rope_type == "default":
            inv_freq, scaling = _default_inv_freq(hf_config, params), 1.0
        elif self.rope_type == "longrope" and layer_type is None:
            inv_freq, scaling = _longrope(hf_config)
        elif self.rope_type in ROPE_INIT_FUNCTIONS and self.rope_type != "longrope":
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[self.rope_type](hf_config, "cpu", **self._by_type)
        else:
            raise UserError(f"unsupported RoPE scaling type '{self.rope_type}'")
        self.original_max = hf_config.max_position_embeddings
        self.inv_freq = inv_freq.float()
        self.attention_scaling = float(scaling)
        self._dynamic_cache: dict[int, tuple[torch.Tensor, float]] = {}
        self._placed: dict[tuple, torch.Tensor] = {}

    def _frequencies(self, max_position: int) -> tuple[torch.Tensor, float]:
        if self.rope_type != "dynamic" or max_position + 1 <= self.original_max:
            return self.inv_freq, self.attention_scaling
        seq_len = max_position + 1
        if seq_len not in self._dynamic_cache:
            inv_freq, scaling = ROPE_INIT_FUNCTIONS["dynamic"](self._hf_config, "cpu", seq_len=seq_len,
                                                              **self._by_type)
            self._dynamic_cache = {seq_len: (inv_freq.float(), float(scaling))}
            self._placed.clear()
        return self._dynamic_cache[seq_len]

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype,
                unscaled: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [B, T] int64. Returns cos, sin: [B, 1, T, head_dim] in `dtype`.

        Angles are computed in float32 like transformers (float64 when the model runs in float64).
        `unscaled` leaves out the attention scaling: a pure rotation, for re-positioning keys."""
        max_position = int(positions.max()) if self.rope_type == "dynamic" else 0
        inv_freq, scaling = self._frequencies(max_position)
        if unscaled:
            scaling = 1.0
        calc_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        key = (id(inv_freq), positions.device, calc_dtype)
        if key not in self._placed:  # one copy per device and precision, not one per step
            self._placed[key] = inv_freq.to(device=positions.device, dtype=calc_dtype)
        inv_freq = self._placed[key]
        freqs = positions[..., None].to(calc_dtype) * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if scaling != 1.0:  # most models: no attention scaling, and two fewer calls a step
            cos, sin = cos * scaling, sin * scaling
        cos, sin = cos.to(dtype), sin.to(dtype)
        return cos[:, None], sin[:, None]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, H, T, D]; cos and sin as wide as the rotary part of each head (its leading dims: the
    rest passes unturned, as Phi-4-mini's partial rotary does)."""
    if cos.shape[-1] != x.shape[-1]:
        turned = cos.shape[-1]
        return torch.cat((apply_rope(x[..., :turned], cos, sin), x[..., turned:]), dim=-1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
