"""Read and check a Hugging Face folder's config.json before any weight is touched.

transformers accepts configs that later divide by zero or fail type checks with a traceback;
here every shape field the decoder uses is checked first and named in a one-line error."""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from triforce.config.model import SUPPORTED_MODEL_TYPES, TEXT_OF_MULTIMODAL
from triforce.errors import UserError

REQUIRED_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
OPTIONAL_SIZES = ("num_key_value_heads", "head_dim", "max_position_embeddings")
SIZE_LIMIT = 1 << 24  # far beyond any released model's width, depth or vocabulary


def read_json_object(path: Path, what: str) -> dict:
    from triforce.paths import read_small

    try:
        data = json.loads(read_small(path, what))
    except ValueError as e:
        raise UserError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise UserError(f"{path} must hold a JSON object ({what}), not a {type(data).__name__}")
    return data


def check_config_fields(raw: dict, where: Path) -> None:
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UserError(f"unsupported architecture {model_type!r} in {where} "
                        f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    if model_type in TEXT_OF_MULTIMODAL:  # a multimodal folder: its text model's fields
        text = raw.get("text_config")
        if not isinstance(text, dict):
            raise UserError(f"{where}: a {model_type} model's 'text_config' must be a JSON object, got {text!r}")
        return check_config_fields({**text, "model_type": TEXT_OF_MULTIMODAL[model_type]}, where)

    def bad(name: str, rule: str):
        return UserError(f"{where}: '{name}' must be {rule}, got {raw[name]!r}")

    for name in REQUIRED_SIZES + OPTIONAL_SIZES:
        if name not in raw or (name in OPTIONAL_SIZES and raw[name] is None):
            if name in REQUIRED_SIZES:
                raise UserError(f"{where} lacks '{name}'")
            continue
        value = raw[name]
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= SIZE_LIMIT:
            raise bad(name, f"a whole number from 1 to {SIZE_LIMIT}")
    heads, kv_heads = raw["num_attention_heads"], raw.get("num_key_value_heads") or raw["num_attention_heads"]
    head_dim = raw.get("head_dim") or raw["hidden_size"] // heads
    if head_dim < 2 or head_dim % 2:
        raise UserError(f"{where}: the head dimension ({head_dim}) must be even for rotary embeddings")
    if heads % kv_heads:
        raise UserError(f"{where}: num_attention_heads ({heads}) is not a multiple of num_key_value_heads ({kv_heads})")
    eps = raw.get("rms_norm_eps", 1e-6)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not (math.isfinite(eps) and eps > 0):
        raise bad("rms_norm_eps", "a positive number")


def read_hf_config(folder: Path):
    """The transformers config of `folder`, checked; its errors become one line."""
    from transformers import AutoConfig

    path = folder / "config.json"
    check_config_fields(read_json_object(path, "the model's configuration"), path)
    try:
        config = AutoConfig.from_pretrained(str(folder))
    except Exception as e:  # transformers' validators raise many kinds; each means a bad file
        message = str(e).strip().splitlines()[-1].strip() if str(e).strip() else type(e).__name__
        raise UserError(f"invalid {path}: {message[:200]}") from None
    return config.text_config if config.model_type in TEXT_OF_MULTIMODAL else config


def generation_eos(folder: Path, hf_config):
    """End-of-sequence ids of generation_config.json, else the model config's."""
    gen = folder / "generation_config.json"
    if gen.exists():
        try:
            eos = read_json_object(gen, "generation settings").get("eos_token_id")
        except UserError as e:
            print(f"warning: {e}; ignoring it", file=sys.stderr)
        else:
            if isinstance(eos, int) or (isinstance(eos, list) and all(isinstance(i, int) for i in eos)):
                return eos
    return getattr(hf_config, "eos_token_id", None)
