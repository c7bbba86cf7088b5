"""The full tier: the target model over its full KV cache (resident or offloaded), holding the
sequence whose KV the cache has. It prefills prompts and verifies the tiers' proposals; a pass
that records queries returns them (per layer) with its logits, for the retrieval cache."""
from __future__ import annotations

import time
from typing import Callable

import torch

from triforce.cache.resident import ResidentKVCache
from triforce.cache_contract import CacheStep, FullCache
from triforce.config import PREFILL_CHUNKS, PREFILL_GROUP
from triforce.decoding.graph_runner import TierRunner, device_tokens
from triforce.errors import UserError
from triforce.model.loading import LoadedModel

PREFILL_CHUNK = PREFILL_CHUNKS[0]  # tokens per prefill forward: bounds activation memory, drives progress

Queries = list[torch.Tensor]  # per layer, post-RoPE queries [B, H, T, D] of T tokens


def latest(kept: torch.Tensor | None, new: torch.Tensor, window: int) -> torch.Tensor:
    """The queries [B, H, <= window, D] of the last `window` tokens of `kept` followed by `new`."""
    return new[:, :, -window:] if kept is None else torch.cat([kept, new], 2)[:, :, -window:]


class FullTier:
    name = kind = "full"

    def __init__(self, lm: LoadedModel, max_len: int, kv_cache: FullCache | None = None,
                 prefill_chunk: int = PREFILL_CHUNK, prefill_group: int = PREFILL_GROUP,
                 runner_mode: str = "eager", agree=None):
        """kv_cache: a prebuilt full cache (offloaded, see triforce.app.plan_and_cache); default: a
        resident cache of max_len tokens on the model's device. prefill_chunk, prefill_group:
        tokens per prefill forward and queries per layer-major attention call (the memory plan's).
        runner_mode, agree: how decoding and verify passes run (decoding.graph_runner) where the
        cache lets their shapes be fixed (see graphable); prefills always run eagerly."""
        if max_len < 1:
            raise UserError("the context must hold at least one token")
        self.lm = lm
        self.model = lm.model
        self.cache = kv_cache if kv_cache is not None else \
            ResidentKVCache(lm.config, max_len, dtype=lm.dtype, device=lm.device, attn=lm.attn)
        self.prefill_chunk, self.prefill_group = prefill_chunk, prefill_group
        self.runner = TierRunner(self.model, self.cache, runner_mode, agree=agree) \
            if runner_mode != "eager" and graphable(self.cache, runner_mode) else None
        self.tokens: list[int] = []
        # the last prefilled tokens' queries, by cache length and window, so covering the same
        # prefix again needs no re-run; dropped when the cache is truncated below that length
        self._query_memo: dict[tuple[int, int], Queries] = {}
        self.prefill_tokens = 0
        self.prefill_s = 0.0
        self.time_s = 0.0  # in forward passes

    @property
    def max_len(self) -> int:
        return self.cache.max_len

    # ---- passes ------------------------------------------------------------------------------
    def forward(self, ids: list[int], num_logits: int | None = None) -> torch.Tensor:
        """Run `ids` through the model after self.tokens; returns logits [T', V]."""
        return self._pass(ids, num_logits, False)[0]

    def logits(self, seq: list[int]) -> torch.Tensor:
        """Feed the part of `seq` not yet cached; logits for each fed token [n, V]."""
        return self.forward(seq[len(self.tokens):])

    def verify(self, seq: list[int], record_queries: bool = False) -> tuple[torch.Tensor, Queries | None]:
        """As logits, and with record_queries each layer's queries of the fed tokens [B, H, n, D]."""
        return self._pass(seq[len(self.tokens):], None, record_queries)

    def _pass(self, ids: list[int], num_logits: int | None, record_queries: bool, prefill: bool = False,
              progress: Callable[[int], None] | None = None,
              record_last: int = 0) -> tuple[torch.Tensor, Queries | None]:
        """One forward pass over `ids` through the cache; the cache rolls back if it fails.
        record_queries: return every fed token's queries; record_last: only the last that many
        tokens' [B, H, <= record_last, D] (a prefill keeps no more than that)."""
        started = time.perf_counter()
        start = len(self.tokens)
        tokens = device_tokens(ids, self.lm.device)
        step = self.cache.step(len(ids), record_queries, prefill=prefill)
        view = _PrefillView(step, len(ids), progress, record_last) if progress or record_last else step
        layer_major = prefill and self.cache.layer_major  # the whole prompt in one pass, layer by layer
        chunking = dict(chunk_tokens=self.prefill_chunk, group_tokens=self.prefill_group) if layer_major else {}
        try:
            if self.runner is not None and not prefill and num_logits is None:
                logits = self.runner.run(ids, step, record_queries)
                step.queries = self.runner.queries
            else:
                logits = self.model(tokens, step.positions, view, num_logits=num_logits, **chunking)[0]
        except BaseException:
            self.cache.rollback(start)
            raise
        self.tokens.extend(ids)
        self.time_s += time.perf_counter() - started
        return logits, view.last_queries if record_last else step.queries

    # ---- input -------------------------------------------------------------------------------
    def prefill(self, ids: list[int], progress: Callable[[int], None] | None = None,
                chunk: int | None = None) -> torch.Tensor | None:
        """Append `ids`; `progress(n)` as they go. Returns the last logits [V]."""
        return self._prefill(ids, progress, chunk, False)[0]

    def _prefill(self, ids: list[int], progress, chunk: int | None,
                 window: int) -> tuple[torch.Tensor | None, Queries | None]:
        """Caches that keep everything on the device take the prompt in chunks through all
        layers; a layer-major cache (offloaded) takes it in one pass, layer by layer. window > 0:
        also the queries of the last `window` tokens (of those fed)."""
        if not ids:
            return None, None
        if len(self.tokens) + len(ids) > self.max_len:
            raise UserError(f"input of {len(ids)} tokens does not fit: the context holds "
                            f"{len(self.tokens)} of {self.max_len} tokens")
        started = time.perf_counter()
        queries = None
        if self.cache.layer_major:
            logits, queries = self._pass(ids, 1, False, prefill=True, progress=progress, record_last=window)
        else:
            chunk = chunk or self.prefill_chunk
            for begin in range(0, len(ids), chunk):
                piece = ids[begin:begin + chunk]
                wanted = window if begin + len(piece) > len(ids) - window else 0  # chunks the window touches
                logits, last = self._pass(piece, 1, False, prefill=True, record_last=wanted)
                if wanted:
                    queries = last if queries is None else [latest(a, b, window) for a, b in zip(queries, last)]
                if progress is not None:
                    progress(len(piece))
        if window:
            self._query_memo = {(len(self.tokens), window): queries}
        self.prefill_tokens += len(ids)
        self.prefill_s += time.perf_counter() - started
        return logits[-1], queries

    def cover(self, ids: list[int], progress: Callable[[int], None] | None = None,
              record_queries: int = 0) -> tuple[int, Queries | None]:
        """Make the cache hold exactly `ids`, reusing the longest common prefix. Returns the
        number of tokens prefilled and, with record_queries = W > 0, the queries [B, H, W', D] of
        the last W' = min(W, len(ids)) tokens (a selection's: retrieval reads 1, SnapKV 32)."""
        window = int(record_queries)
        keep = self.kept(ids, window)
        if window and keep == len(ids) and (keep, window) in self._query_memo:
            self.truncate(keep)
            return 0, self._query_memo[(keep, window)]
        self.truncate(keep)
        queries = self._prefill(ids[keep:], progress, None, window)[1]
        return len(ids) - keep, queries

    def kept(self, ids: list[int], record_queries: int = 0) -> int:
        """How many leading tokens of `ids` cover() keeps (the rest it prefills): the common
        prefix, less the last record_queries tokens it must re-run to record their queries
        unless it remembers them."""
        keep = self.reusable_prefix(ids)
        if record_queries and keep == len(ids) and keep > 0 and (keep, record_queries) in self._query_memo:
            return keep
        return min(keep, max(0, len(ids) - record_queries)) if record_queries else keep

    def adopt(self, tokens: list[int]) -> None:
        """Take the cache's first len(tokens) entries as the KV of `tokens`: another engine of
        the same model filled this cache (one long prefill shared by several methods)."""
        if len(tokens) > self.cache.length:
            raise ValueError(f"the cache holds {self.cache.length} tokens, not {len(tokens)}")
        self.cache.rollback(len(tokens))
        self.tokens = list(tokens)
        self._query_memo = {}

    def reusable_prefix(self, ids: list[int]) -> int:
        """How many leading tokens of `ids` already have their KV cached."""
        common = 0
        for a, b in zip(self.tokens, ids):
            if a != b:
                break
            common += 1
        return common

    def prepare_verify(self) -> None:
        """Let the cache fetch ahead what the coming full verify reads (offloaded caches)."""
        self.cache.prepare_verify()

    def start(self, seq: list[int]) -> None:
        pass  # the engine prefills it (cover) before the levels below take the sequence up

    def covered(self) -> int:
        return len(self.tokens)

    def truncate(self, length: int) -> None:
        """Keep only the first `length` tokens (no-op if fewer are held)."""
        if length < len(self.tokens):
            self.cache.rollback(length)
            del self.tokens[length:]
            self._query_memo = {key: q for key, q in self._query_memo.items() if key[0] <= length}


def graphable(cache, runner_mode: str) -> bool:
    """Whether the full tier's short passes over `cache` run at a fixed shape: a resident cache
    (an offloaded one streams by the host's schedule) without sliding windows (the fixed view
    masks causally only), in graphs where the attention reads only the filled entries (a chat's
    cache holds the whole context: SDPA's masked fixed path would read all of it each step);
    uncaptured (static, the graphs' reference) wherever the rest holds."""
    if not isinstance(cache, ResidentKVCache) or any(w is not None for w in cache.sliding_windows):
        return False
    return runner_mode == "static" or cache.attn.fixed_reads_filled_only(cache.k_buf)


class _PrefillView:
    """A prefill's view of its step: reports progress as layers finish (a layer's share of the
    pass's tokens) and, with record_last = W, keeps each layer's queries of the last W tokens only
    (a layer-major pass attends group by group, in token order)."""

    def __init__(self, step: CacheStep, total: int, progress: Callable[[int], None] | None, record_last: int):
        self.window = record_last
        self.step, self.total, self.progress, self.reported = step, total, progress, 0
        self.positions = step.positions
        self.last_queries: Queries | None = [None] * step.num_layers if record_last else None

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = self.step.attend(layer, q, k, v)
        if self.last_queries is not None:
            # not a view: the pass's queries are freed
            self.last_queries[layer] = latest(self.last_queries[layer], q, self.window).clone()
        if self.progress is not None and self.step.layer_done(layer):
            done = self.total * (layer + 1) // self.step.num_layers
            if done > self.reported:
                self.progress(done - self.reported)
                self.reported = done
        return out
