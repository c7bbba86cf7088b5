"""`--max-context N --rope-scaling yarn|linear|dynamic`: run a model past the context it was
trained on, as llama.cpp's --rope-scaling does, by rewriting its RoPE parameters with the factor
N / trained context before the model is built. transformers' RoPE functions then compute the
frequencies (triforce.model.rope), so each kind means what it means there:

- linear: positions divided by the factor (Chen et al., position interpolation);
- yarn: per-frequency interpolation with attention scaling (Peng et al.); the trained context is
  kept as `original_max_position_embeddings`;
- dynamic: NTK-aware base stretched only once a pass reaches past the trained context, so
  short inputs are computed exactly as without scaling."""
from __future__ import annotations

import copy

from triforce.config.model import layer_rope_parameters, rope_parameters
from triforce.errors import UserError

KINDS = ("yarn", "linear", "dynamic")


def trained_context(hf_config) -> int:
    return int(hf_config.max_position_embeddings)


def stretch(hf_config, context: int, kind: str):
    """A copy of `hf_config` whose RoPE reaches `context` tokens; the model's context becomes
    `context` (returned second). The model's own RoPE must be unscaled: scaling a scaled model
    again has no published meaning."""
    if kind not in KINDS:
        raise UserError(f"unknown --rope-scaling '{kind}' (choose {', '.join(KINDS)})")
    trained = trained_context(hf_config)
    if context <= trained:
        raise UserError(f"--rope-scaling {kind} stretches past the model's {trained}-token context; "
                        f"--max-context {context} is within it (leave out --rope-scaling)")
    if layer_rope_parameters(hf_config) is not None:
        raise UserError(f"--rope-scaling {kind}: this model's layers turn by RoPE of their own kinds (Gemma 3's local "
                        f"and global); its {trained}-token context is what it runs")
    params = rope_parameters(hf_config)
    current = params.get("rope_type", params.get("type", "default"))
    if current != "default":
        raise UserError(f"the model already uses '{current}' RoPE scaling (its context is {trained} tokens); "
                        "--rope-scaling applies to unscaled models")
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    factor = context / trained
    stretched = copy.deepcopy(hf_config)
    new = {"rope_type": kind, "factor": factor, "rope_theta": theta}
    if "partial_rotary_factor" in params:
        new["partial_rotary_factor"] = params["partial_rotary_factor"]
    if kind == "yarn":
        new["original_max_position_embeddings"] = trained
    stretched.rope_parameters = new  # transformers 5's name (rope_scaling is its deprecated alias)
    if kind != "dynamic":  # dynamic reads max_position_embeddings as where its stretching starts
        stretched.max_position_embeddings = context
    return stretched, context


def stretch_request(max_context: int | None, kind: str | None) -> tuple[int, str] | None:
    """(context, kind) for load_model's rope_scaling, or None without --rope-scaling."""
    if kind is None:
        return None
    if max_context is None:
        raise UserError("--rope-scaling needs --max-context N, the context to stretch the model to")
    return max_context, kind


def run_context(model_context: int, wanted: int | None) -> int:
    """A run's context: --max-context within the model's (stretched) context, else the model's."""
    if wanted is None:
        return model_context
    if wanted < 2:
        raise UserError(f"--max-context must be >= 2, got {wanted}")
    if wanted > model_context:
        raise UserError(f"--max-context {wanted} exceeds the model's {model_context}-token context; add "
                        "--rope-scaling yarn (or linear, dynamic) to stretch it that far")
    return wanted
