"""Drafting tiers below the full cache. Each covers a prefix of the shared sequence with its
own cache, feeds the rest on `logits(seq)`, and rolls back on `truncate(n)`."""
from __future__ import annotations

import time
from typing import Protocol

import numpy as np
import torch

from triforce.cache.sparse import SelectionPolicy, SparseKVCache
from triforce.cache.streaming import StreamingKVCache
from triforce.cache_contract import FullCache
from triforce.config import SpecParams
from triforce.decoding.draft import Draft
from triforce.decoding.graph_runner import TierRunner
from triforce.errors import UserError
from triforce.model.loading import LoadedModel


class Tier(Protocol):
    """What the engine asks of every level (the full tier included)."""
    name: str
    kind: str                    # the cost model's kind of pass: lookup | draft | sparse | full
    runner: TierRunner | None    # the forward passes kept as CUDA graphs (None: not a drafting model)
    time_s: float

    def covered(self) -> int:
        """Tokens of the sequence the tier's cache stands for (the rest is fed to it)."""

    def truncate(self, length: int) -> None:
        """Forget everything from token `length` on."""

    def start(self, seq: list[int]) -> None:
        """Take up a new sequence once the full tier holds it (a drafting level below the full one)."""


class ModelTier:
    """A model over some cache; `logits(seq)` feeds seq[cache.length:]. runner_mode: how its
    forward passes run (triforce.decoding.graph_runner: eager, static, graph); agree: under tensor
    parallelism, whether every rank captured a graph (all or none take it)."""
    kind = "draft"

    def __init__(self, name: str, lm: LoadedModel, cache, vocab_size: int, runner_mode: str = "eager", agree=None):
        self.name, self.lm, self.model, self.cache = name, lm, lm.model, cache
        self.vocab_size = vocab_size  # the target's: drafts live in the target's vocabulary
        self.runner = TierRunner(lm.model, cache, runner_mode, agree=agree)
        self.time_s = 0.0

    def covered(self) -> int:
        return self.cache.length

    def start(self, seq: list[int]) -> None:
        pass  # fed as it drafts; a sparse cache is selected by the engine's upkeep

    def logits(self, seq: list[int]) -> torch.Tensor:
        started = time.perf_counter()
        start = self.cache.length
        tokens = seq[start:]
        step = self.cache.step(len(tokens))
        try:
            logits = self.runner.run(tokens, step)
        except BaseException:
            self.cache.rollback(start)
            raise
        self.time_s += time.perf_counter() - started
        return _fit_vocab(logits, self.vocab_size)

    def truncate(self, length: int) -> None:
        if self.cache.length > length:
            self.cache.rollback(length)


def _fit_vocab(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """A draft model's logits in the target's vocabulary (padded ids can never be drafted)."""
    extra = vocab_size - logits.shape[-1]
    if extra > 0:
        return torch.nn.functional.pad(logits, (0, extra), value=float("-inf"))
    return logits[..., :vocab_size] if extra < 0 else logits


class SparseTier(ModelTier):
    """The target model over a sparse cache selected from the full cache (retrieval or
    StreamingLLM). After each full verify it takes the exact KV of the accepted tokens."""

    kind = "sparse"

    def __init__(self, name: str, lm: LoadedModel, policy, max_appended: int,
                 runner_mode: str = "eager", agree=None):
        cache = SparseKVCache(lm.config, policy, max_appended, dtype=lm.dtype, device=lm.device, attn=lm.attn)
        super().__init__(name, lm, cache, lm.config.vocab_size, runner_mode, agree)
        self.rebuilds = 0

    def rebuild(self, full: FullCache, queries: list[torch.Tensor] | None) -> None:
        self.cache.rebuild(full, queries)
        self.rebuilds += 1

    def commit(self, full: FullCache, start: int, end: int) -> None:
        """Replace what this tier computed for tokens [start, end) with the full cache's KV."""
        self.cache.rollback(start)
        self.cache.append_from(full, start, end)


class DraftModelTier(ModelTier):
    """A separate small model with a StreamingLLM cache of its own."""

    def __init__(self, draft: LoadedModel, target: LoadedModel, sink_tokens: int, window: int, slack: int,
                 runner_mode: str = "eager", agree=None):
        check_same_tokenizer(draft, target)
        cache = StreamingKVCache(draft.config, draft.model.layer_ropes, sink_tokens, window, slack,
                                 dtype=draft.dtype, device=draft.device, attn=draft.attn)
        super().__init__("draft", draft, cache, target.config.vocab_size, runner_mode, agree)
        self.tokens: list[int] = []  # the sequence prefix the cache stands for

    def covered(self) -> int:
        return len(self.tokens)  # its window holds fewer entries than the tokens it stands for

    def logits(self, seq: list[int]) -> torch.Tensor:
        start = self.cache.length
        logits = super().logits(seq)
        self.tokens[start:] = seq[start:]
        return logits

    def truncate(self, length: int) -> None:
        super().truncate(length)
        del self.tokens[length:]

    def start(self, seq: list[int]) -> None:
        """Cover seq[:-1]: roll back if the cache already stands for it (within the window),
        else prefill only the sink tokens and the most recent window."""
        cache = self.cache
        covered = len(seq) - 1
        if cache.length >= covered and self.tokens[:covered] == seq[:covered] \
                and cache.length - covered <= cache.end - cache.sink_tokens:
            self.truncate(covered)
            return
        cache.reset()
        self.tokens = []
        sinks = min(cache.sink_tokens, covered)
        recent = min(cache.window, covered - sinks)
        if sinks:
            self.logits(seq[:sinks])
        cache.skip_to(covered - recent)
        self.tokens = list(seq[:covered - recent])
        if recent:
            self.logits(seq[:covered])


def check_same_tokenizer(draft: LoadedModel, target: LoadedModel) -> None:
    if draft.tokenizer is None or target.tokenizer is None:
        return  # random-weight architectures (benchmarks) have no tokenizer; ids are all they share
    if draft.tokenizer.get_vocab() != target.tokenizer.get_vocab():
        raise UserError(f"the draft model's tokenizer ({draft.path}) differs from the target's "
                        f"({target.path}); speculative decoding needs the same vocabulary")


class LookupDrafter:
    """Prompt-lookup drafting: find the latest earlier occurrence of the sequence's last n-gram
    (longest n first) and propose the tokens that followed it. Deterministic (one-hot q)."""

    name = kind = "lookup"
    runner = None

    def __init__(self, max_ngram: int = 3):
        self.max_ngram = max_ngram
        self.time_s = 0.0

    def propose(self, seq: list[int], count: int) -> list[int]:
        started = time.perf_counter()
        try:
            return self._propose(np.asarray(seq, dtype=np.int64), count)
        finally:
            self.time_s += time.perf_counter() - started

    def _propose(self, arr: np.ndarray, count: int) -> list[int]:
        for n in range(min(self.max_ngram, len(arr) - 1), 0, -1):
            pattern = arr[-n:]
            windows = np.lib.stride_tricks.sliding_window_view(arr[:-1], n)
            hits = np.flatnonzero((windows == pattern).all(axis=1))
            if len(hits):
                start = int(hits[-1]) + n
                return arr[start:start + count].tolist()
        return []

    def covered(self) -> int:
        return 0  # no cache: it reads the sequence itself

    def truncate(self, length: int) -> None:
        pass

    def start(self, seq: list[int]) -> None:
        pass  # no cache: it reads the sequence itself


def build_levels(lm: LoadedModel, spec: SpecParams, draft: Draft, full, runner_mode: str, agree_ok=None) -> list:
    """The tiers from bottom to top: tier 0 (draft model or lookup) where the method has one, the
    sparse tier (retrieval or streaming) where it has one, and the full tier. agree_ok: under
    tensor parallelism, graph capture succeeds on every rank or on none."""
    levels: list[Tier] = []
    if draft.kind == "lookup":
        levels.append(LookupDrafter())
    elif draft.kind == "model":
        levels.append(DraftModelTier(draft.model, lm, spec.sink_tokens, spec.draft_window_tokens, spec.draft_slack,
                                     runner_mode, agree_ok))
    if spec.uses_sparse_cache:
        kind = spec.sparse_policy
        policy = SelectionPolicy(kind, spec.budget, spec.chunk_size, spec.sink_tokens, spec.snapkv_window)
        if policy.kind == "retrieval":
            full.cache.expect_chunks(spec.chunk_size)
        levels.append(SparseTier(kind, lm, policy, spec.sparse_append_slots, runner_mode, agree_ok))
    levels.append(full)
    return levels


def prepare_graphs(levels: list, spec: SpecParams) -> None:
    """Capture every tier's CUDA graphs for each step length it will run, up front: the full
    tier's verify records its queries where a sparse tier reads them."""
    longest = spec.longest_graph_step
    sparse = any(t.kind == "sparse" for t in levels)
    for tier in levels:
        if tier.runner is not None:
            tier.runner.prepare(range(1, longest + 1), record=sparse and tier.kind == "full")
