"""Turning logits into tokens: temperature, top-k, top-p, greedy.

`probabilities` is the one place logits become a distribution, so every comparison of two
distributions (speculative verification) filters both the same way."""
from __future__ import annotations

import torch

from triforce.config import SamplingParams


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits: [..., V] -> probabilities [..., V] (float32, or float64 for float64 logits) after
    temperature, then top-k, then top-p, in the order transformers applies them."""
    if params.greedy:
        raise ValueError("greedy decoding has no distribution; use argmax")
    calc = logits.to(torch.float64 if logits.dtype == torch.float64 else torch.float32)
    calc = calc / params.temperature
    if params.top_k and params.top_k < calc.shape[-1]:
        kth = torch.topk(calc, params.top_k, dim=-1).values[..., -1:]
        calc = calc.masked_fill(calc < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(calc, dim=-1)  # ascending
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        drop_sorted = cumulative <= 1 - params.top_p
        drop_sorted[..., -1] = False  # always keep the most likely token
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        calc = calc.masked_fill(drop, float("-inf"))
    return calc.softmax(-1)


def make_generator(params: SamplingParams, device: torch.device | str = "cpu") -> torch.Generator:
    gen = torch.Generator(device=device)
    if params.seed is not None:
        gen.manual_seed(params.seed)
    else:
        gen.seed()
    return gen


def sample(probs: torch.Tensor, generator: torch.Generator) -> int:
    """Draw one token from probs [V]."""
    return int(torch.multinomial(probs, 1, generator=generator))


def next_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """logits: [V]. Greedy is a true argmax, not a small temperature."""
    if params.greedy:
        return int(torch.argmax(logits))
    return sample(probabilities(logits, params), generator)
