"""The full tier: one sequence's full KV cache and the target model over it."""
from __future__ import annotations

import time
from typing import Callable

import torch

from triforce.errors import UserError
from triforce.cache.resident import FullKVCache
from triforce.model.loading import LoadedModel
from triforce.decoding.graph_runner import device_tokens

PREFILL_CHUNK = 1024  # tokens per prefill forward: bounds activation memory, drives progress


class Session:
    """Holds `tokens`, the sequence whose KV is in `cache`. Also serves as the top tier of the
    speculative engine (`logits`, `truncate`)."""

    name = "full"

    def __init__(self, lm: LoadedModel, max_len: int, kv_cache=None, prefill_chunk: int = PREFILL_CHUNK):
        """kv_cache: a prebuilt full cache (e.g. offloaded, see triforce.app.plan_and_cache); default: a
        FullKVCache of max_len tokens on the model's device. prefill_chunk: tokens per prefill
        forward (the memory plan sizes activations for it)."""
        if max_len < 1:
            raise UserError("the context must hold at least one token")
        self.lm = lm
        self.model = lm.model
        self.cache = kv_cache if kv_cache is not None else \
            FullKVCache(lm.config, max_len, dtype=lm.dtype, device=lm.device, attn=lm.attn)
        self.prefill_chunk = prefill_chunk
        self.tokens: list[int] = []
        self.last_queries: list[torch.Tensor] | None = None  # per layer [B, H, T, D], last recorded forward
        # queries of the last token of a prefill, by cache length, so a re-sync to the same prefix
        # needs no re-run; dropped when the cache is truncated below that length
        self._query_memo: dict[int, list[torch.Tensor]] = {}
        self.prefill_tokens = 0
        self.prefill_s = 0.0
        self.time_s = 0.0  # in forward passes

    @property
    def max_len(self) -> int:
        return self.cache.max_len

    def forward(self, ids: list[int], num_logits: int | None = None, record_queries: bool = False) -> torch.Tensor:
        """Run `ids` through the model after self.tokens; returns logits [T', V]."""
        return self._step(ids, record_queries,
                          lambda tokens, step: self.model(tokens, step.positions, step, num_logits=num_logits))[0]

    def _step(self, ids: list[int], record_queries: bool, run) -> torch.Tensor:
        """One forward pass over `ids` through the cache; the cache rolls back if it fails."""
        started = time.perf_counter()
        start = len(self.tokens)
        tokens = device_tokens(ids, self.lm.device)
        step = self.cache.step(len(ids), record_queries)
        try:
            logits = run(tokens, step)
        except BaseException:
            self.cache.rollback(start)
            raise
        self.tokens.extend(ids)
        if record_queries:
            self.last_queries = step.queries
        self.time_s += time.perf_counter() - started
        return logits

    def logits(self, seq: list[int], record_queries: bool = False) -> torch.Tensor:
        """Feed the part of `seq` not yet cached; logits for each fed token [n, V]."""
        return self.forward(seq[len(self.tokens):], record_queries=record_queries)

    def prefill(self, ids: list[int], progress: Callable[[int], None] | None = None,
                chunk: int | None = None, record_queries: bool = False) -> torch.Tensor | None:
        """Append `ids` in chunks; `progress(n)` after each chunk. Returns the last logits [V].
        With record_queries, last_queries holds each layer's query of the last token [B, H, D]."""
        if not ids:
            return None
        chunk = chunk or self.prefill_chunk
        if len(self.tokens) + len(ids) > self.max_len:
            raise UserError(f"input of {len(ids)} tokens does not fit: the context holds "
                            f"{len(self.tokens)} of {self.max_len} tokens")
        started = time.perf_counter()
        if self.cache.layer_major:
            logits = self._prefill_layer_major(ids, progress, chunk, record_queries)
        else:
            logits = None
            for begin in range(0, len(ids), chunk):
                piece = ids[begin:begin + chunk]
                last_chunk = begin + chunk >= len(ids)
                logits = self.forward(piece, num_logits=1, record_queries=record_queries and last_chunk)[-1]
                if progress is not None:
                    progress(len(piece))
        if record_queries:
            self.last_queries = [q[:, :, -1] for q in self.last_queries]
            self._query_memo = {len(self.tokens): self.last_queries}
        self.prefill_tokens += len(ids)
        self.prefill_s += time.perf_counter() - started
        return logits

    def _prefill_layer_major(self, ids: list[int], progress, chunk: int, record_queries: bool) -> torch.Tensor:
        """One layer at a time over all of `ids` (caches that send each finished layer's KV to
        the host); progress advances by a layer's share of the tokens."""
        layers = self.lm.config.num_layers
        reported = [0]

        def on_layer(index: int) -> None:
            done = len(ids) * (index + 1) // layers
            if progress is not None and done > reported[0]:
                progress(done - reported[0])
            reported[0] = done

        return self._step(ids, record_queries, lambda tokens, step: self.model.forward_layer_major(
            tokens, step.positions, step, chunk, 1, on_layer))[0, -1]

    def prepare_verify(self) -> None:
        """Let the cache fetch ahead what the coming full verify reads (offloaded caches)."""
        self.cache.prepare_verify()

    def truncate(self, length: int) -> None:
        """Keep only the first `length` tokens (no-op if fewer are held)."""
        if length < len(self.tokens):
            self.cache.rollback(length)
            del self.tokens[length:]
            self._query_memo = {n: q for n, q in self._query_memo.items() if n <= length}

    def reusable_prefix(self, ids: list[int]) -> int:
        """How many leading tokens of `ids` already have their KV cached."""
        common = 0
        for a, b in zip(self.tokens, ids):
            if a != b:
                break
            common += 1
        return common

    def sync_to(self, ids: list[int], progress: Callable[[int], None] | None = None,
                record_queries: bool = False) -> int:
        """Make the cache hold exactly `ids`, reusing the longest common prefix.
        Returns the number of tokens prefilled."""
        keep = self.reusable_prefix(ids)
        if record_queries and keep == len(ids) and keep > 0:
            self.truncate(keep)
            if keep in self._query_memo:
                self.last_queries = self._query_memo[keep]
                return 0
            keep -= 1  # re-run the last token so its queries are recorded
        self.truncate(keep)
        self.prefill(ids[keep:], progress, record_queries=record_queries)
        return len(ids) - keep
