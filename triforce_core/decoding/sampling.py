"""Turning logits into tokens: penalties, temperature, top-k, top-p, greedy.

`penalize` then `probabilities` is the one way logits become a distribution (or, greedy, an
argmax), so every comparison of two distributions (speculative verification) sees both the same
way, each row with the penalties of its own context."""
from __future__ import annotations

import torch

from triforce.config import SamplingParams
from triforce.decoding.graph_runner import host_ids
from triforce.kernels.cpu import distribution, gumbel_max, penalties
from triforce.kernels.cpu.draw import NO_MASS, draw
from triforce.kernels.device_kind import on_cuda


def penalize(rows: torch.Tensor, seq: list[int], params: SamplingParams) -> torch.Tensor:
    """rows: [R, V] logits, the last following all of `seq` and row j following its first
    len(seq) - R + 1 + j tokens (a verify's rows after its drafts). Each row with the penalties of
    its own context's last params.penalty_last_n tokens; rows unchanged without penalties. The
    windows go to the device as one non-blocking copy: no host sync."""
    if not params.penalized:
        return rows
    count, vocab = rows.shape
    first = len(seq) - count + 1
    windows = [seq[max(0, first + j - params.penalty_last_n):first + j] for j in range(count)]
    width = max(len(w) for w in windows)
    if width == 0:
        return rows
    calc = rows.to(torch.float64 if rows.dtype == torch.float64 else torch.float32)
    if penalties.takes(calc):  # host rows: one loop over the windows (kernels.cpu.penalties says why)
        return penalties.penalized(calc, windows, params.repeat_penalty, params.frequency_penalty,
                                   params.presence_penalty)
    padded = [w + [vocab] * (width - len(w)) for w in windows]  # vocab: a column cut below
    ids = host_ids(padded, rows.device).to(rows.device, non_blocking=True)
    counts = torch.zeros(count, vocab + 1, dtype=calc.dtype, device=rows.device)
    counts = counts.scatter_add_(1, ids, torch.ones(ids.shape, dtype=calc.dtype, device=rows.device))[:, :vocab]
    present = counts > 0
    if params.repeat_penalty != 1:
        calc = torch.where(present, torch.where(calc > 0, calc / params.repeat_penalty, calc * params.repeat_penalty),
                           calc)
    return calc - counts * params.frequency_penalty - present.to(calc.dtype) * params.presence_penalty


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits: [..., V] -> probabilities [..., V] (float32, or float64 for float64 logits) after
    temperature, then top-k, then top-p, in the order transformers applies them."""
    if params.greedy:
        raise ValueError("greedy decoding has no distribution; use argmax")
    calc = logits.to(torch.float64 if logits.dtype == torch.float64 else torch.float32)
    if distribution.takes(calc, params.top_k):  # host float32: one loop a row (kernels.cpu.distribution says why)
        probs, flagged = distribution.distributions(calc, params.temperature, params.top_k, params.top_p)
        for row in flagged:  # a nucleus wider than the loop's candidates: this row by sorting
            probs.view(-1, probs.shape[-1])[row] = _filtered(calc.reshape(-1, calc.shape[-1])[row], params).softmax(-1)
        return probs
    return _filtered(calc, params).softmax(-1)


def _filtered(calc: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """calc / temperature with -inf where top-k, then top-p, drop (torch's operators on any device)."""
    calc = calc / params.temperature
    if params.top_k and params.top_k < calc.shape[-1]:
        kth = torch.topk(calc, params.top_k, dim=-1).values[..., -1:]
        calc = calc.masked_fill(calc < kth, float("-inf"))
    if params.top_p < 1.0:
        calc = _nucleus(calc, params.top_p)
    return calc


# candidates for top-p's nucleus, the host loop's own: sorting the whole vocabulary cost chat's sampling
# over a third of its speed on a CPU (bench/history/2026-11-28-long-document-server.md)
NUCLEUS_CANDIDATES = distribution.CANDIDATES


def _nucleus(calc: torch.Tensor, top_p: float) -> torch.Tensor:
    """calc with -inf where top-p drops: each token is kept whose more likely tokens hold less than
    top_p of the mass (the most likely always). On a CPU, when every row's nucleus lies among its
    NUCLEUS_CANDIDATES most likely tokens (their mass without the last reaches top_p), from those
    alone; else, and on a card (where the check would make the host wait), by sorting every row."""
    if not on_cuda(calc) and calc.shape[-1] > NUCLEUS_CANDIDATES:
        values, index = torch.topk(calc, NUCLEUS_CANDIDATES, dim=-1)  # descending
        probs = (values - torch.logsumexp(calc, -1, keepdim=True)).exp()
        above = probs.cumsum(-1) - probs  # the mass of each candidate's more likely ones
        if bool((above[..., -1] >= top_p).all()):
            keep = above < top_p
            keep[..., 0] = True
            return torch.full_like(calc, float("-inf")).scatter(-1, index, values.masked_fill(~keep, float("-inf")))
    sorted_logits, order = torch.sort(calc, dim=-1)  # ascending
    cumulative = sorted_logits.softmax(-1).cumsum(-1)
    drop_sorted = cumulative <= 1 - top_p
    drop_sorted[..., -1] = False  # always keep the most likely token
    drop = drop_sorted.scatter(-1, order, drop_sorted)
    return calc.masked_fill(drop, float("-inf"))


_MASK64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    """SplitMix64's finaliser: 64 well-mixed bits from 64 (so nearby seeds and positions draw
    unrelated streams)."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def choice_seed(seed: int, choice: int) -> int:
    """The seed of choice `choice` (n > 1) of a request seeded `seed`: the seed itself for the
    first (so it equals the request with n = 1), a 64-bit mix of both for the others, in the
    range every seed is (no seed + i that could overflow)."""
    return seed if choice == 0 else _mix64((seed & _MASK64) ^ _mix64(choice))


class PositionNoise:
    """A seeded sample drawn so that it depends on the seed, the context and the token's position
    alone: the token at sequence position t is argmax(log p_t + g_t), with g_t Gumbel noise drawn
    from (seed, t). That is an exact sample of p_t (the Gumbel-max trick), and every tier uses the
    same g_t: a draft is accepted where it equals the target's own choice, so the text a seed gives
    is the one plain decoding gives, whatever drafts, cache reuse or batch placement came before
    (drafter-invariant speculative decoding: Daliri, Musco and Suresh, 2024). The price: drafts
    agree a little less often than with speculative sampling's acceptance test, used unseeded.
    g_t's uniforms are SplitMix64's outputs from a key of (seed, t), word by word: the host's loop
    (kernels.cpu.gumbel_max) draws those of the words with probability, a card every word's, the
    same numbers."""

    KEEP = 64  # positions whose noise is kept: a round's drafts, its verify and the next round's

    def __init__(self, seed: int):
        self.key = _mix64(seed & _MASK64)
        self._held: dict[tuple[int, int, torch.device], torch.Tensor] = {}

    def gumbel(self, position: int, vocab: int, device: torch.device) -> torch.Tensor:
        """[vocab] float64 Gumbel(0, 1) noise of `position`, on `device`."""
        slot = (position, vocab, torch.device(device))
        if slot not in self._held:
            if len(self._held) >= self.KEEP:
                del self._held[next(iter(self._held))]
            u = _uniforms(_mix64((self.key + position) & _MASK64), vocab, device)
            self._held[slot] = -torch.log(-torch.log(u))
        return self._held[slot]

    def choose(self, probs: torch.Tensor, first_position: int) -> torch.Tensor:
        """probs: [R, V], row r the distribution of position first_position + r -> [R] token ids."""
        if gumbel_max.takes(probs):
            return torch.tensor(self.host_choices(probs, first_position)[:-1], device="cpu")
        noise = torch.stack([self.gumbel(first_position + r, probs.shape[-1], probs.device)
                             for r in range(probs.shape[0])])
        return (probs.to(torch.float64).log() + noise).argmax(-1)

    def host_choices(self, probs: torch.Tensor, first_position: int) -> list[int]:
        """choose's ids for host probabilities (`gumbel_max.takes`), then 1 if any is inf or NaN,
        else 0: one loop, the noise drawn for the words with probability alone (the uniforms
        `gumbel` draws for every word)."""
        keys = [_mix64((self.key + first_position + r) & _MASK64) for r in range(probs.shape[0])]
        return gumbel_max.choices(probs, keys)


def _uniforms(key: int, vocab: int, device: torch.device) -> torch.Tensor:
    """[vocab] float64 uniforms in (0, 1) under a 64-bit key, word j's as kernels.cpu.gumbel_max's
    `uniform` draws it (SplitMix64's output j + 1), on any device: int64 arithmetic, which wraps
    as uint64's does, with logical shifts."""
    x = torch.arange(1, vocab + 1, dtype=torch.int64, device=device) * _signed(0x9E3779B97F4A7C15) + _signed(key)
    x = (x ^ _shifted(x, 30)) * _signed(0xBF58476D1CE4E5B9)
    x = (x ^ _shifted(x, 27)) * _signed(0x94D049BB133111EB)
    x = x ^ _shifted(x, 31)
    return (_shifted(x, 11).to(torch.float64) + 0.5) * 2.0 ** -53


def _signed(bits: int) -> int:
    """64 bits as the int64 that holds them."""
    return bits - (1 << 64) if bits >= 1 << 63 else bits


def _shifted(x: torch.Tensor, by: int) -> torch.Tensor:
    """x >> by as on uint64 (torch's >> on int64 keeps the sign)."""
    return (x >> by) & ((1 << (64 - by)) - 1)


def make_generator(params: SamplingParams, device: torch.device | str = "cpu") -> torch.Generator:
    gen = torch.Generator(device=device)
    if params.seed is not None:
        gen.manual_seed(params.seed)
    else:
        gen.seed()
    return gen


def sample(probs: torch.Tensor, generator: torch.Generator) -> int:
    """Draw one token from probs [V]; NaN or infinite ones raise NonFiniteLogits. On the CPU a
    loop over the cumulative sums checks them as it draws; a card's multinomial would end in a
    device-side assert (the process's CUDA context lost), so there the draw is from a sanitised
    distribution and the check is read with the token, in the one transfer the token needs anyway."""
    if on_cuda(probs):
        bad = ~torch.isfinite(probs).all()
        drawn = torch.multinomial(torch.where(bad, torch.ones_like(probs), probs), 1, generator=generator)
        token, broken = torch.cat((drawn, bad[None].long())).tolist()
        if broken:
            from triforce.decoding.numerics import NonFiniteLogits
            raise NonFiniteLogits()
        return token
    if probs.dim() == 1 and probs.dtype in (torch.float32, torch.float64):  # ~16x multinomial (kernels.cpu.draw)
        token = draw(probs.contiguous().numpy(), float(torch.rand((), dtype=torch.float64, generator=generator,
                                                                  device=probs.device)))
        if token == NO_MASS:
            raise RuntimeError("invalid multinomial distribution (sum of probabilities <= 0)")  # as multinomial
        if token < 0:  # multinomial's words for NaN, inf and negative alike
            from triforce.decoding.numerics import NonFiniteLogits
            raise NonFiniteLogits()
        return token
    try:
        return int(torch.multinomial(probs, 1, generator=generator))
    except RuntimeError as e:
        if "inf" in str(e) or "nan" in str(e):
            from triforce.decoding.numerics import NonFiniteLogits
            raise NonFiniteLogits() from None
        raise


def next_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """logits: [V]. Greedy is a true argmax, not a small temperature."""
    if params.greedy:
        return int(torch.argmax(logits))
    return sample(probabilities(logits, params), generator)
