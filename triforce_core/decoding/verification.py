"""Exact speculative verification of drafted tokens (pure math; no model, no cache).

Sampling: accept draft x with probability min(1, p(x)/q(x)); on the first rejection sample from
the normalised residual max(0, p - q); if every draft is accepted, sample a bonus token from p.
The emitted tokens are then distributed exactly as sampling from p. Greedy: accept while the
draft equals argmax p, then emit argmax p."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Verdict:
    accepted: int   # drafts kept, a prefix
    token: int      # the token emitted after them (correction or bonus)


def verify_greedy(drafts: list[int], target_logits: torch.Tensor) -> Verdict:
    """target_logits: [len(drafts) + 1, V]; row i predicts the token after draft i - 1."""
    best = torch.argmax(target_logits, dim=-1).tolist()
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == best[accepted]:
        accepted += 1
    return Verdict(accepted, best[accepted])


def verify_sampled(drafts: list[int], draft_probs: list[torch.Tensor | None], target_probs: torch.Tensor,
                   generator: torch.Generator) -> Verdict:
    """draft_probs[i]: the distribution draft i was sampled from ([V]), or None for a
    deterministic draft (one-hot, e.g. prompt lookup). target_probs: [len(drafts) + 1, V]."""
    for i, token in enumerate(drafts):
        p = target_probs[i]
        q = draft_probs[i]
        q_token = 1.0 if q is None else float(q[token])
        ratio = float(p[token]) / q_token if q_token > 0 else 0.0
        # the uniform is drawn where the generator lives (a CUDA generator cannot fill a CPU tensor)
        u = float(torch.rand((), generator=generator, dtype=torch.float64, device=generator.device))
        if u < ratio:
            continue
        if q is None:
            residual = p.clone()
            residual[token] = 0.0
        else:
            residual = torch.clamp(p - q, min=0.0)
        if float(residual.sum()) <= 0:  # only reachable through rounding
            residual = p
        return Verdict(i, int(torch.multinomial(residual / residual.sum(), 1, generator=generator)))
    return Verdict(len(drafts), int(torch.multinomial(target_probs[len(drafts)], 1, generator=generator)))
