"""A model's own sampling defaults, the one source `triforce chat`, the Python API (a call without
sampling parameters) and the server (a request's absent fields) take them from: the model folder's
generation_config.json (temperature, top_p, top_k, repetition_penalty; do_sample false means
greedy), which a GGUF file's general.sampling.* fields fill when it is converted. A model that
sets none of them gets triforce's chat defaults (triforce.config.CHAT_SAMPLING); one that sets
some gets the others neutral (top-p 1, top-k 0, no penalty), as its authors gave them, and
decodes greedily where it says do_sample false or gives no temperature without do_sample true
(transformers' reading)."""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from triforce.config import CHAT_SAMPLING, SamplingParams
from triforce.errors import UserError

# generation_config.json's names -> SamplingParams'
GENERATION_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                     "repetition_penalty": "repeat_penalty"}
# a GGUF file's (llama.cpp's general.sampling.*) -> generation_config.json's
GGUF_FIELDS = {"general.sampling.temp": "temperature", "general.sampling.top_p": "top_p",
               "general.sampling.top_k": "top_k", "general.sampling.penalty_repeat": "repetition_penalty"}
OWN_SOURCE = "triforce's chat defaults; the model sets none"


@dataclass(frozen=True)
class ModelSampling:
    params: SamplingParams
    source: str  # where they came from, for the line printed at start

    def given(self, flags) -> "ModelSampling":
        """These defaults with the values of a command's flags (cli.options.SamplingFlags) over them."""
        source = f"{self.source}; flags given over it" if flags.sets_model_defaults else self.source
        return ModelSampling(flags.over(self.params), source)

    def describe(self) -> str:
        p = self.params
        parts = [f"temperature {p.temperature:g}", f"top-p {p.top_p:g}"]
        parts += [f"top-k {p.top_k}"] if p.top_k else []
        parts += [f"repeat penalty {p.repeat_penalty:g}"] if p.repeat_penalty != 1 else []
        return f"sampling: {', '.join(parts)} ({self.source})"


FALLBACK = ModelSampling(CHAT_SAMPLING, OWN_SOURCE)


def read_sampling_defaults(folder: Path) -> ModelSampling:
    """The defaults of the model in `folder` (FALLBACK where it sets none; a value out of range
    or of the wrong type is left out, with a warning)."""
    from triforce.model.hf_config import read_json_object

    path = folder / "generation_config.json"
    if not path.exists():
        return FALLBACK
    try:
        config = read_json_object(path, "generation settings")
    except UserError as e:
        print(f"warning: {e}; ignoring it", file=sys.stderr)
        return FALLBACK
    given = {}
    for name, field in GENERATION_FIELDS.items():
        value = config.get(name)
        if value is None:
            continue
        try:
            given[field] = _checked(field, value)
        except UserError as e:
            print(f"warning: {path}: {name} {value!r} ignored ({e})", file=sys.stderr)
    if not given:
        return FALLBACK
    if config.get("do_sample") is not True and (config.get("do_sample") is False or "temperature" not in given):
        given["temperature"] = 0.0  # transformers decodes greedily unless do_sample
    given.setdefault("temperature", 1.0)
    return ModelSampling(SamplingParams(**given), f"the model's {path.name}")


def _checked(field: str, value) -> float | int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise UserError("not a finite number")
    if field == "top_k":
        if value != int(value):
            raise UserError("not an integer")
        value = int(value)
    SamplingParams(**{field: value})  # in range, or a UserError saying why
    return value


def gguf_generation_fields(reader) -> dict:
    """generation_config.json's fields from a GGUF file's general.sampling.* (a GGUFReader)."""
    fields = {}
    for key, name in GGUF_FIELDS.items():
        field = reader.fields.get(key)
        if field is not None:
            fields[name] = field.contents()
    if fields:
        fields["do_sample"] = fields.get("temperature", 1.0) > 0
    return fields


def model_sampling(lm) -> ModelSampling:
    """A loaded model's defaults (FALLBACK for a random-weight architecture)."""
    return getattr(lm, "sampling_defaults", None) or FALLBACK


def with_given(defaults: SamplingParams, **given) -> SamplingParams:
    """The defaults with the values a user gave (None: not given) in their place."""
    return replace(defaults, **{k: v for k, v in given.items() if v is not None})
