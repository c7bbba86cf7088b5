"""The speculative decoding engine: one loop over a stack of tiers.

levels[0] proposes by sampling from its own distribution (or by prompt lookup); every level
above checks the proposals of the level below with exact speculative sampling and passes on
tokens distributed exactly as its own model, together with that distribution, which is what
the next level verifies against. The top level is the target with its full cache (Session).
With a single level this is plain autoregressive decoding.

Sequence convention: `seq` ends with a *pending* token whose KV no cache holds yet; every cache
covers a prefix of seq[:-1]."""
from __future__ import annotations

import time
from collections import deque
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Callable

import torch

from triforce.config import SamplingParams, SpecParams
from triforce.errors import UserError
from triforce.model.loading import LoadedModel
from triforce.offload.planner import MAX_GRAPH_TOKENS
from triforce.decoding.graph_runner import runner_mode
from triforce.decoding.sampling import make_generator, probabilities, sample
from triforce.decoding.full_tier import PREFILL_CHUNK, Session
from triforce.cache.sparse import SelectionPolicy
from triforce.decoding.verification import Verdict, verify_greedy, verify_sampled
from triforce.decoding.sync_count import SyncCounter
from triforce.decoding.tiers import DraftModelTier, LookupDrafter, SparseTier

ROLLING_ROUNDS = 8  # full verifies in the rolling acceptance that can trigger a rebuild


@dataclass
class LevelStats:
    proposed: int = 0
    accepted: int = 0
    rounds: int = 0
    emitted: int = 0


@dataclass
class GenerationResult:
    tokens: list[int]
    stopped_by: str  # eos | length | context | interrupt
    time_s: float
    stats: dict = field(default_factory=dict)


class Engine:
    def __init__(self, lm: LoadedModel, spec: SpecParams, max_len: int,
                 draft: LoadedModel | str | None = None, kv_cache=None, prefill_chunk: int = PREFILL_CHUNK,
                 graphs: str = "auto"):
        """kv_cache: the full cache to use (see triforce.app.plan_and_cache.build_kv_cache); default resident.
        prefill_chunk: tokens per prefill forward (a memory plan's `prefill_chunk`). graphs: how
        the drafting tiers run (auto: CUDA graphs on CUDA, eager elsewhere; off: eager; static:
        the graphs' fixed-shape path without capture, see triforce.decoding.graph_runner)."""
        self.lm, self.spec = lm, spec
        self.runner_mode = runner_mode(graphs, lm.device)
        self.session = Session(lm, max_len, kv_cache, prefill_chunk)
        self.levels: list = []
        if spec.method in ("triforce", "naive"):
            drafter = self._build_drafter(draft)
            if drafter is not None:
                self.levels.append(drafter)
        if spec.uses_sparse_cache:
            kind = "streaming" if spec.method == "streaming" else "retrieval"
            policy = SelectionPolicy(kind, spec.budget, spec.chunk_size, spec.sink_tokens)
            self.levels.append(SparseTier(kind, lm, policy, spec.sparse_append_slots, self.runner_mode))
        self.levels.append(self.session)
        self.sparse_tiers = [t for t in self.levels if isinstance(t, SparseTier)]
        # drafts each verifying level checks per round: the full tier gamma2, a middle one gamma1
        self.gammas = [0] + [spec.gamma1] * (len(self.levels) - 2) + [spec.gamma2]
        self.verifiers = {t.name: verify_sampled for t in self.levels[1:]}
        self.seq: list[int] = []
        self.latest_queries: list[torch.Tensor] | None = None  # per layer [B, H, D], last committed token
        self._rolling: deque = deque(maxlen=ROLLING_ROUNDS)
        self.params = SamplingParams()
        self.generator: torch.Generator | None = None
        self.stats = [LevelStats() for _ in self.levels]
        self.rounds: list[tuple[str, int, int]] = []  # (tier, proposed, accepted) of each check
        self.replay = None  # a ReplayVerifier decides checks instead of the models (benchmarks)
        # tensor parallelism: every decision passes through agree (rank 0's values win)
        self.agree: Callable[[list[int]], list[int]] | None = None
        self.stop_requested: Callable[[], bool] | None = None  # asked before each round (TP chat's Ctrl-C)
        self.gamma2_controller = None  # picks gamma2 from the observed acceptance (cost model)
        self.sync_counter: SyncCounter | None = None  # --count-syncs: host syncs per phase (CUDA)

    def _build_drafter(self, draft):
        spec = self.spec
        if draft is None or draft == "lookup":
            return LookupDrafter()
        if draft == "none":
            if spec.method == "naive":
                raise UserError("--method naive needs a draft (a model path or 'lookup')")
            return None
        return DraftModelTier(draft, self.lm, spec.sink_tokens, spec.draft_window_tokens, spec.draft_slack,
                              self.runner_mode)

    @property
    def max_len(self) -> int:
        return self.session.max_len

    def describe(self) -> str:
        return " -> ".join(t.name for t in self.levels)

    # ---- input -------------------------------------------------------------------------
    def sync(self, ids: list[int], progress: Callable[[int], None] | None = None) -> int:
        """Make the sequence `ids` (the last token pending), reusing cached KV where it can.
        Returns the number of tokens prefilled into the full cache."""
        if not ids:
            raise UserError("empty input")
        if len(ids) > self.max_len:
            raise UserError(f"input of {len(ids)} tokens does not fit the {self.max_len}-token context")
        self.seq = list(ids)
        record = bool(self.sparse_tiers)
        prefilled = self.session.sync_to(ids[:-1], progress, record_queries=record)
        self.latest_queries = self.session.last_queries if record and len(ids) > 1 else None
        for tier in self.levels[:-1]:
            if isinstance(tier, SparseTier):
                tier.rebuild(self.session.cache, self.latest_queries)
            elif isinstance(tier, DraftModelTier):
                tier.sync(self.seq)
        return prefilled

    # ---- decoding ----------------------------------------------------------------------
    def generate(self, max_new_tokens: int, params: SamplingParams, stop_ids: frozenset[int] = frozenset(),
                 on_token: Callable[[int], None] | None = None,
                 generator: torch.Generator | None = None) -> GenerationResult:
        if not self.seq:
            raise RuntimeError("generate needs input: call sync first")
        self.params = params
        self.generator = generator or make_generator(params, self.lm.device)
        self.stats = [LevelStats() for _ in self.levels]
        self.rounds = []
        self._prepare_graphs()
        times_before = {t.name: t.time_s for t in self.levels}
        rebuilds_before = sum(t.rebuilds for t in self.sparse_tiers)
        started = time.perf_counter()
        out: list[int] = []
        counting = self.sync_counter.recording(self.lm.device) if self.sync_counter is not None else nullcontext()
        with counting:
            stopped_by = self._generate_loop(out, max_new_tokens, stop_ids, on_token)
        elapsed = time.perf_counter() - started
        tier_time = {t.name: round(t.time_s - times_before[t.name], 4) for t in self.levels}
        rebuilds = sum(t.rebuilds for t in self.sparse_tiers) - rebuilds_before
        stats = self._stats(tier_time, rebuilds)
        if self.sync_counter is not None:
            stats["host_syncs"] = self.sync_counter.report(len(out))
        return GenerationResult(out, stopped_by, elapsed, stats)

    def _prepare_graphs(self) -> None:
        """Capture the drafting tiers' CUDA graphs for every step length they will run, up front."""
        longest = min(MAX_GRAPH_TOKENS, max(self.spec.gamma1, self.spec.gamma2) + 1)
        for tier in self.levels:
            runner = getattr(tier, "runner", None)
            if runner is not None:
                runner.prepare(range(1, longest + 1))

    def _phase(self, name: str):
        return self.sync_counter.phase(name) if self.sync_counter is not None else nullcontext()

    def _generate_loop(self, out: list[int], max_new_tokens: int, stop_ids, on_token) -> str:
        top = len(self.levels) - 1
        stopped_by = "length"
        base = len(self.seq)
        try:
            while len(out) < max_new_tokens:
                base = len(self.seq)
                limit = min(max_new_tokens - len(out), self.max_len - base + 1)
                if limit <= 0:
                    stopped_by = "context"
                    break
                if self.stop_requested is not None and self.stop_requested():
                    stopped_by = "interrupt"
                    break
                with self._phase("cache upkeep"):
                    self._ensure_sparse_room()
                    self.session.prepare_verify()  # offloaded KV starts streaming while tiers below draft
                self._round(top, limit)
                new = self.seq[base:]
                stop_at = next((i for i, t in enumerate(new) if t in stop_ids), None)
                if stop_at is not None:
                    self.stats[-1].emitted -= len(new) - (stop_at + 1)
                    del self.seq[base + stop_at + 1:]
                    self._truncate_all(len(self.seq) - 1)
                with self._phase("cache upkeep"):
                    self._after_full_verify(base - 1)
                self._adapt_gamma2()
                for token in self.seq[base:]:
                    out.append(token)
                    if on_token is not None:
                        on_token(token)
                if stop_at is not None:
                    stopped_by = "eos"
                    break
        except KeyboardInterrupt:
            stopped_by = "interrupt"
            del self.seq[base:]  # drop the unverified round; committed tokens stay
            self._truncate_all(len(self.seq) - 1)
        return stopped_by

    def _round(self, level: int, limit: int) -> list[torch.Tensor | None]:
        """One check at `level` (level 0: one sampled token). Appends the emitted tokens to seq
        and returns the distribution each was drawn from (None when greedy or deterministic)."""
        if level == 0:
            return self._propose_bottom(1)
        tier = self.levels[level]
        base = len(self.seq)
        want = min(self.gammas[level], limit - 1)
        draft_dists = self._propose(level - 1, want) if want > 0 else []
        drafts = self.seq[base:]
        with self._phase(f"{tier.name} forward"):
            if tier is self.session:
                logits = tier.logits(self.seq, record_queries=bool(self.sparse_tiers))
            else:
                logits = tier.logits(self.seq)
        rows = logits[-(len(drafts) + 1):]
        with self._phase(f"{tier.name} verify"):
            if self.replay is not None:
                verdict, probs = self.replay.verdict(tier.name, drafts, rows), None
            elif self.params.greedy:
                verdict, probs = verify_greedy(drafts, rows), None
            else:
                probs = probabilities(rows, self.params)
                verdict = self.verifiers[tier.name](drafts, draft_dists, probs, self.generator)
            if self.agree is not None:
                verdict = Verdict(*self.agree([verdict.accepted, verdict.token]))
        del self.seq[base + verdict.accepted:]
        self.seq.append(verdict.token)
        for lower in self.levels[:level + 1]:
            lower.truncate(len(self.seq) - 1)
        self.rounds.append((tier.name, len(drafts), verdict.accepted))
        stats = self.stats[level]
        stats.proposed += len(drafts)
        stats.accepted += verdict.accepted
        stats.rounds += 1
        stats.emitted += verdict.accepted + 1
        if level == len(self.levels) - 1:
            self._rolling.append((len(drafts), verdict.accepted))
        return [None if probs is None else probs[i] for i in range(verdict.accepted + 1)]

    def _propose(self, level: int, count: int) -> list[torch.Tensor | None]:
        """Append about `count` tokens drawn from level `level`'s distribution (a lookup drafter
        may find fewer); returns their distributions."""
        if level == 0:
            return self._propose_bottom(count)
        dists: list = []
        while len(dists) < count:
            dists += self._round(level, count - len(dists))
        return dists

    def _propose_bottom(self, count: int) -> list[torch.Tensor | None]:
        tier = self.levels[0]
        if isinstance(tier, LookupDrafter):
            tokens = tier.propose(self.seq, count)
            self.seq.extend(tokens)
            return [None] * len(tokens)
        dists = []
        for _ in range(count):
            with self._phase(f"{tier.name} forward"):
                logits = tier.logits(self.seq)[-1]
            with self._phase(f"{tier.name} sample"):
                if self.params.greedy:
                    token, dist = int(torch.argmax(logits)), None
                else:
                    dist = probabilities(logits, self.params)
                    token = sample(dist, self.generator)
                if self.agree is not None:
                    token = self.agree([token])[0]
            self.seq.append(token)
            dists.append(dist)
        if tier is self.session:
            self.stats[0].rounds += count
            self.stats[0].emitted += count
        return dists

    # ---- cache upkeep ------------------------------------------------------------------
    def _truncate_all(self, length: int) -> None:
        for tier in self.levels:
            tier.truncate(length)

    def _after_full_verify(self, committed_before: int) -> None:
        """Give sparse tiers the exact KV of the newly committed tokens; rebuild when due."""
        if not self.sparse_tiers:
            return
        committed = len(self.seq) - 1
        queries = self.session.last_queries
        if queries is not None:
            row = committed - 1 - committed_before  # the last committed token's row in the verify pass
            if 0 <= row < queries[0].shape[2]:
                self.latest_queries = [q[:, :, row] for q in queries]
        proposed = sum(p for p, _ in self._rolling)
        rolling = sum(a for _, a in self._rolling) / proposed if proposed else 1.0
        for tier in self.sparse_tiers:
            tier.commit(self.session.cache, committed_before, committed)
            stale = tier.cache.appended >= self.spec.rebuild_stride
            struggling = rolling < self.spec.rebuild_threshold and tier.cache.appended >= 2 * self.spec.gamma2
            if stale or struggling:
                tier.rebuild(self.session.cache, self.latest_queries)
                self._rolling.clear()

    def _adapt_gamma2(self) -> None:
        """Move gamma2 toward what the cost model prefers at the acceptance seen lately."""
        if self.gamma2_controller is None or len(self.levels) < 2:
            return
        proposed = sum(p for p, _ in self._rolling)
        if proposed:
            observed = sum(a for _, a in self._rolling) / proposed
            self.gammas[-1] = self.gamma2_controller.choose(observed)

    def _ensure_sparse_room(self) -> None:
        need = self.spec.gamma1 + self.spec.gamma2_range[1] + 2
        for tier in self.sparse_tiers:
            if tier.cache.room < need:
                tier.rebuild(self.session.cache, self.latest_queries)

    def _stats(self, tier_time: dict, rebuilds: int) -> dict:
        top = self.stats[-1]
        acceptance = {self.levels[i].name: round(s.accepted / s.proposed, 4)
                      for i, s in enumerate(self.stats) if i > 0 and s.proposed}
        return {
            "tiers": self.describe(),
            "acceptance_rates": acceptance,
            "proposed": {self.levels[i].name: s.proposed for i, s in enumerate(self.stats) if i > 0},
            "accepted": {self.levels[i].name: s.accepted for i, s in enumerate(self.stats) if i > 0},
            "full_verifies": top.rounds,
            "gamma2": self.gammas[-1] if len(self.levels) > 1 else None,
            "mean_tokens_per_full_verify": round(top.emitted / top.rounds, 4) if top.rounds else None,
            "tier_time_s": tier_time,
            "rebuilds": rebuilds,  # during this call (the rebuild at sync time is not counted)
        }
