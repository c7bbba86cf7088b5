"""A decoding session: one sequence, its full KV cache, and the logits after its last token."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from triforce.config import SamplingParams
from triforce.errors import UserError
from triforce.kv_cache import FullKVCache
from triforce.loading import LoadedModel
from triforce.sampling import make_generator, next_token

PREFILL_CHUNK = 1024  # tokens per prefill forward: bounds activation memory, drives progress


@dataclass
class DecodeResult:
    tokens: list[int]
    stopped_by: str  # "eos", "length", "interrupt", "context"
    time_s: float


@dataclass
class SessionStats:
    prefill_tokens: int = 0
    prefill_s: float = 0.0
    decode_tokens: int = 0
    decode_s: float = 0.0
    extra: dict = field(default_factory=dict)


class Session:
    def __init__(self, lm: LoadedModel, max_len: int):
        if max_len < 1:
            raise UserError("the context must hold at least one token")
        self.lm = lm
        self.cache = FullKVCache(lm.config, max_len, dtype=lm.dtype, device=lm.device)
        self.tokens: list[int] = []  # tokens whose KV is in the cache
        self.last_logits: torch.Tensor | None = None  # [V], after self.tokens[-1]
        self.stats = SessionStats()

    @property
    def max_len(self) -> int:
        return self.cache.max_len

    def forward(self, ids: list[int], num_logits: int | None = None) -> torch.Tensor:
        """Run `ids` through the model after self.tokens; returns logits [T', V]."""
        start = len(self.tokens)
        device = self.lm.device
        tokens = torch.tensor([ids], dtype=torch.long, device=device)
        positions = torch.arange(start, start + len(ids), device=device)[None]
        step = self.cache.step(len(ids))
        try:
            logits = self.lm.model(tokens, positions, step, num_logits=num_logits)
        except BaseException:
            self.cache.rollback(start)
            raise
        self.tokens.extend(ids)
        return logits[0]

    def prefill(self, ids: list[int], progress: Callable[[int], None] | None = None,
                chunk: int = PREFILL_CHUNK) -> None:
        """Append `ids` in chunks; `progress(n)` is called with each chunk's size."""
        if not ids:
            return
        if len(self.tokens) + len(ids) > self.max_len:
            raise UserError(f"input of {len(ids)} tokens does not fit: the context holds "
                            f"{len(self.tokens)} of {self.max_len} tokens")
        started = time.perf_counter()
        for begin in range(0, len(ids), chunk):
            piece = ids[begin:begin + chunk]
            self.last_logits = self.forward(piece, num_logits=1)[-1]
            if progress is not None:
                progress(len(piece))
        self.stats.prefill_tokens += len(ids)
        self.stats.prefill_s += time.perf_counter() - started

    def truncate(self, length: int) -> None:
        """Keep only the first `length` tokens; the logits after them must be recomputed."""
        self.cache.rollback(length)
        del self.tokens[length:]
        self.last_logits = None

    def reusable_prefix(self, ids: list[int]) -> int:
        """How many leading tokens of `ids` can keep their cached KV; at least one token is
        always re-run so that fresh logits come out."""
        common = 0
        for a, b in zip(self.tokens, ids):
            if a != b:
                break
            common += 1
        return min(common, len(ids) - 1)

    def sync_to(self, ids: list[int], progress: Callable[[int], None] | None = None) -> int:
        """Make the session hold exactly `ids`, reusing the longest common prefix of KV.
        Returns the number of tokens that had to be prefilled."""
        if not ids:
            raise UserError("empty input")
        if ids == self.tokens and self.last_logits is not None:
            return 0
        keep = self.reusable_prefix(ids)
        self.truncate(keep)
        self.prefill(ids[keep:], progress)
        return len(ids) - keep

    def decode_ar(self, max_new_tokens: int, params: SamplingParams, stop_ids: frozenset[int],
                  on_token: Callable[[int], None] | None = None,
                  generator: torch.Generator | None = None) -> DecodeResult:
        """Plain autoregressive decoding from self.last_logits. The final sampled token is
        returned but not run through the model (the next turn does that)."""
        if self.last_logits is None:
            raise RuntimeError("decode needs logits: prefill or sync_to first")
        generator = generator or make_generator(params, self.lm.device)
        started = time.perf_counter()
        out: list[int] = []
        stopped_by = "length"
        logits = self.last_logits
        try:
            while len(out) < max_new_tokens:
                token = next_token(logits, params, generator)
                out.append(token)
                if on_token is not None:
                    on_token(token)
                if token in stop_ids:
                    stopped_by = "eos"
                    break
                if len(out) == max_new_tokens:
                    break
                if len(self.tokens) + 1 > self.max_len:
                    stopped_by = "context"
                    break
                logits = self.forward([token])[-1]
                self.last_logits = logits
        except KeyboardInterrupt:
            stopped_by = "interrupt"
        elapsed = time.perf_counter() - started
        self.stats.decode_tokens += len(out)
        self.stats.decode_s += elapsed
        return DecodeResult(out, stopped_by, elapsed)
