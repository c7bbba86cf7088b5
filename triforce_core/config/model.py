"""A model's shape and variants, read from a transformers config and checked when built."""
from __future__ import annotations

from dataclasses import dataclass

from triforce.errors import UserError

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma3_text", "gemma3")
# folders of a multimodal model whose text model runs (its config's text_config; the vision tower is left unread)
TEXT_OF_MULTIMODAL = {"gemma3": "gemma3_text"}
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")  # the MLP's gate activation (Gemma's is GELU's tanh form)


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    qkv_bias: bool  # Qwen2 has q/k/v biases but no o_proj bias
    o_bias: bool
    mlp_bias: bool
    tie_word_embeddings: bool
    sliding_windows: tuple[int | None, ...]  # per layer; None = full attention
    qk_norm: bool = False  # Qwen3: an RMSNorm over each head of q and k, before RoPE
    rotary_dim: int | None = None  # the leading dims of each head RoPE turns (Phi-4-mini: 3/4); None = all
    activation: str = "silu"
    # Gemma 3: norms scale by 1 + weight, and norm the attention's and the MLP's outputs too
    gemma_norms: bool = False
    embed_scale: float | None = None  # Gemma: embeddings times sqrt(hidden)
    query_scale: float | None = None  # attention's 1/sqrt(d) when d is not head_dim (Gemma 3 27B)

    def __post_init__(self):
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise UserError(f"unsupported architecture '{self.model_type}' "
                            f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
        if self.num_heads % self.num_kv_heads:
            raise UserError(f"num_attention_heads ({self.num_heads}) is not a multiple of "
                            f"num_key_value_heads ({self.num_kv_heads})")
        if len(self.sliding_windows) != self.num_layers:
            raise UserError("sliding window list does not match the number of layers")
        if self.rotary_dim is not None and not (2 <= self.rotary_dim <= self.head_dim and self.rotary_dim % 2 == 0):
            raise UserError(f"the rotary part of a head ({self.rotary_dim}) must be even and within its {self.head_dim} dims")
        if self.activation not in ACTIVATIONS:
            raise UserError(f"unsupported MLP activation '{self.activation}' (supported: {', '.join(ACTIVATIONS)})")

    @classmethod
    def from_hf(cls, hf) -> "ModelConfig":
        """Build from a transformers PretrainedConfig."""
        model_type = getattr(hf, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UserError(f"unsupported architecture '{model_type}' "
                            f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
        gemma = model_type == "gemma3_text"
        for cap in ("attn_logit_softcapping", "final_logit_softcapping"):  # Gemma 2's, not Gemma 3's
            if getattr(hf, cap, None) is not None:
                raise UserError(f"'{cap}' ({getattr(hf, cap)}) is not supported (Gemma 3 models have none)")
        num_heads = hf.num_attention_heads
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // num_heads
        num_layers = hf.num_hidden_layers
        window = getattr(hf, "sliding_window", None)
        layer_types = getattr(hf, "layer_types", None)
        one_window = model_type in ("mistral", "phi3")  # the same window on every layer, or none
        if one_window or not layer_types:
            windows = (window if one_window else None,) * num_layers
        else:
            windows = tuple(window if t == "sliding_attention" else None for t in layer_types)
        return cls(
            model_type=model_type,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=hf.rms_norm_eps,
            max_position_embeddings=hf.max_position_embeddings,
            qkv_bias=model_type == "qwen2" or bool(getattr(hf, "attention_bias", False)),
            o_bias=model_type != "qwen2" and bool(getattr(hf, "attention_bias", False)),
            mlp_bias=bool(getattr(hf, "mlp_bias", False)),
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            sliding_windows=windows,
            qk_norm=model_type in ("qwen3", "gemma3_text"),
            rotary_dim=_rotary_dim(hf, head_dim),
            activation=getattr(hf, "hidden_activation", None) or getattr(hf, "hidden_act", None) or "silu",
            gemma_norms=gemma,
            embed_scale=hf.hidden_size ** 0.5 if gemma else None,
            query_scale=_query_scale(hf, head_dim),
        )


def rope_parameters(hf) -> dict:
    """A transformers config's RoPE parameters (transformers 5's `rope_parameters`, else the older
    `rope_scaling`), as a new dict."""
    return dict(getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {})


def _query_scale(hf, head_dim: int) -> float | None:
    scalar = getattr(hf, "query_pre_attn_scalar", None)
    return None if scalar is None or scalar == head_dim else float(scalar) ** -0.5


def layer_rope_parameters(hf) -> dict[str, dict] | None:
    """Gemma 3's RoPE parameters by layer type ({"sliding_attention": {...}, "full_attention": {...}}),
    or None where one set serves every layer."""
    params = rope_parameters(hf)
    types = set(getattr(hf, "layer_types", None) or ())
    if types and types <= params.keys() and all(isinstance(params[t], dict) for t in types):
        return {t: dict(params[t]) for t in types}
    return None


def _rotary_dim(hf, head_dim: int) -> int | None:
    params = rope_parameters(hf)
    factor = params.get("partial_rotary_factor", getattr(hf, "partial_rotary_factor", 1.0))
    dim = int(head_dim * factor)  # transformers' rounding (triforce.model.rope)
    return None if dim == head_dim else dim
