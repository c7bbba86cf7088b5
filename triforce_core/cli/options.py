"""Flags shared by several commands, and turning them into config objects."""
from __future__ import annotations

import click

from triforce.config import SamplingParams
from triforce.errors import UserError

model_option = click.option("--model", "model", default="default", show_default=True,
                            help="Hugging Face folder, .gguf file, or 'default' (SmolLM2-135M-Instruct).")
dtype_option = click.option("--dtype", type=click.Choice(["auto", "float32", "float64", "bfloat16", "float16"]),
                            default="auto", show_default=True,
                            help="Weights and KV precision; auto = float32 on CPU, bfloat16 on CUDA.")
device_option = click.option("--device", default="auto", show_default=True,
                             help="cpu, cuda or cuda:N; auto picks CUDA when present.")


def sampling_options(default_temperature: float):
    def decorate(f):
        f = click.option("--seed", type=int, default=None, help="Random seed for reproducible sampling.")(f)
        f = click.option("--top-k", type=int, default=0, show_default=True,
                         help="Keep only the k most likely tokens (0 = off).")(f)
        f = click.option("--top-p", type=float, default=1.0, show_default=True,
                         help="Nucleus sampling mass, in (0, 1].")(f)
        f = click.option("--temperature", type=float, default=default_temperature, show_default=True,
                         help="0 = greedy (argmax).")(f)
        return f
    return decorate


def build_sampling(temperature: float, top_p: float, top_k: int, seed: int | None) -> SamplingParams:
    return SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)


def check_non_negative(name: str, value: int) -> None:
    if value < 0:
        raise UserError(f"{name} must be >= 0, got {value}")
