"""Exact speculative verification of drafted tokens (pure math; no model, no cache).

Sampling: accept draft x with probability min(1, p(x)/q(x)); on the first rejection sample from
the normalised residual max(0, p - q); if every draft is accepted, sample a bonus token from p.
The emitted tokens are then distributed exactly as sampling from p. Greedy: accept while the
draft equals argmax p, then emit argmax p. Seeded (decoding.sampling.PositionNoise): accept while
the draft equals the target's own Gumbel-max choice at its position, then emit that choice."""
from __future__ import annotations

from dataclasses import dataclass

import torch


from triforce.decoding.graph_runner import host_ids
from triforce.decoding.numerics import NonFiniteLogits
from triforce.decoding.sampling import PositionNoise, make_generator, sample
from triforce.kernels.cpu import greedy, gumbel_max


@dataclass
class Verdict:
    accepted: int   # drafts kept, a prefix
    token: int      # the token emitted after them (correction or bonus)


def verify_greedy(drafts: list[int], target_logits: torch.Tensor) -> Verdict:
    """target_logits: [len(drafts) + 1, V]; row i predicts the token after draft i - 1."""
    if greedy.takes(target_logits):  # host logits: one pass of a loop (kernels.cpu.greedy says why)
        *best, bad = greedy.choices(target_logits)
        return _kept(drafts, best, bad)
    return _agreeing(drafts, torch.argmax(target_logits, dim=-1), target_logits)


def _agreeing(drafts: list[int], choices: torch.Tensor, rows: torch.Tensor) -> Verdict:
    """Keep the drafts while each equals the target's own choice ([len(drafts) + 1] ids), then
    emit the target's; `rows` (what the choices came from) must be finite. One read of both."""
    bad = (~torch.isfinite(rows)).any()
    *best, bad = torch.cat([choices, bad[None].long()]).tolist()
    return _kept(drafts, best, bad)


def _kept(drafts: list[int], best: list[int], bad) -> Verdict:
    if bad:
        raise NonFiniteLogits()
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == best[accepted]:
        accepted += 1
    return Verdict(accepted, best[accepted])


class Draws:
    """A sampled request's randomness. Unseeded, or with a generator given: speculative sampling,
    each draft tested against its own distribution (verify_sampled). Seeded: every token drawn
    from (seed, position) alone (sampling.PositionNoise, verify_coupled), so the text a seed gives
    does not depend on the method, the cache or the batch that produced it."""

    def __init__(self, params, device: torch.device, generator: torch.Generator | None = None):
        self.generator = generator or make_generator(params, device)
        self.seeded = params.seed is not None and not params.greedy
        self.noise = PositionNoise(params.seed) if self.seeded and generator is None else None

    @property
    def follow_rounds(self) -> bool:
        """Whether a seeded request's draws depend on which rounds speculate (a generator given
        beside the seed): its text repeats only where those rounds do."""
        return self.noise is None and self.seeded

    def token(self, dist: torch.Tensor, position: int) -> int:
        """One token of `dist` ([V]) for sequence position `position`."""
        if self.noise is not None:
            return verify_coupled([], dist[None], self.noise, position).token
        return sample(dist, self.generator)

    def verdict(self, drafts: list[int], draft_dists: list, target_probs: torch.Tensor, position: int) -> Verdict:
        if self.noise is not None:
            return verify_coupled(drafts, target_probs, self.noise, position)
        return verify_sampled(drafts, draft_dists, target_probs, self.generator)


def verify_coupled(drafts: list[int], target_probs: torch.Tensor, noise, first_position: int) -> Verdict:
    """target_probs: [len(drafts) + 1, V], row i the distribution of position first_position + i;
    noise: the request's PositionNoise. The target's choices are exact samples of its distributions
    whatever the drafts were, so the accepted prefix and the token after it are too."""
    if gumbel_max.takes(target_probs):  # host rows: one loop (kernels.cpu.gumbel_max says why)
        *best, bad = noise.host_choices(target_probs, first_position)
        return _kept(drafts, best, bad)
    return _agreeing(drafts, noise.choose(target_probs, first_position), target_probs)


def verify_sampled(drafts: list[int], draft_probs: list[torch.Tensor | None], target_probs: torch.Tensor,
                   generator: torch.Generator) -> Verdict:
    """draft_probs[i]: the distribution draft i was sampled from ([V]), or None for a
    deterministic draft (one-hot, e.g. prompt lookup). target_probs: [len(drafts) + 1, V].

    Every draft is judged at once on the device: a uniform per draft, the residual of every
    position and a token drawn from each (the bonus row's from p), then one read of the first
    rejection and the tokens: one host sync per verify, not three per draft. The uniforms and
    tokens past the first rejection go unused; each is independent of the rest, so the emitted
    tokens are distributed as the one-at-a-time procedure's."""
    n = len(drafts)
    device = target_probs.device
    p = target_probs[:n]
    rows = target_probs[n:n + 1]
    if n:
        tokens = host_ids([drafts], device).to(device, non_blocking=True)[0]  # [n], no wait
        q = torch.stack([torch.zeros_like(p[i]).scatter_(0, tokens[i:i + 1], 1.0) if dist is None else dist.to(p.dtype)
                         for i, dist in enumerate(draft_probs[:n])])
        p_token = p.gather(1, tokens[:, None])[:, 0].to(torch.float64)
        q_token = q.gather(1, tokens[:, None])[:, 0].to(torch.float64)
        ratio = torch.where(q_token > 0, p_token / q_token.clamp_min(torch.finfo(torch.float64).tiny), 0.0)
        # the uniforms are drawn where the generator lives (a CUDA generator cannot fill a CPU tensor)
        u = torch.rand(n, generator=generator, dtype=torch.float64, device=generator.device).to(device)
        accepted = (u < ratio).to(torch.int64).cumprod(0).sum(0, keepdim=True)  # the accepted prefix
        residual = torch.clamp(p - q, min=0.0)
        residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p)  # all zero only through rounding
        rows = torch.cat([residual, rows])
    else:
        accepted = torch.zeros(1, dtype=torch.int64, device=device)
    # a token from every row by its inverse CDF (zero-probability tokens are never reached). One
    # multinomial over all rows drew them from the CPU's exponential_, whose extra draws biased the
    # drafts that followed (test_sampling_distribution's retrieval case, two seeds, p = 0.0003)
    cdf = rows.to(torch.float64).cumsum(-1)
    w = torch.rand(cdf.shape[0], generator=generator, dtype=torch.float64, device=generator.device).to(device)
    drawn = torch.searchsorted(cdf, (w * cdf[:, -1])[:, None], right=True)[:, 0].clamp_max(cdf.shape[1] - 1)
    bad = (~torch.isfinite(target_probs)).any()[None].long()
    count, bad, *choices = torch.cat([accepted, bad, drawn]).tolist()  # the one host sync
    if bad:
        raise NonFiniteLogits()
    return Verdict(count, choices[count])
