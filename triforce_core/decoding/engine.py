"""The speculative decoding engine: one loop over a stack of tiers.

levels[0] proposes by sampling from its own distribution (or by prompt lookup); every level
above checks the proposals of the level below with exact speculative sampling and passes on
tokens distributed exactly as its own model, together with that distribution, which is what
the next level verifies against. The top level is the target with its full cache (FullTier).
With a single level this is plain autoregressive decoding.

Sequence convention: `seq` ends with a *pending* token whose KV no cache holds yet; every cache
covers a prefix of seq[:-1]."""
from __future__ import annotations

import time
from contextlib import nullcontext
from functools import partial
from typing import Callable

import torch

from triforce.config import AUTO, SamplingParams, SpecParams
from triforce.decoding.draft import resolve_draft
from triforce.decoding.draft_ahead import Ahead, AheadRunner, AheadTally, wanted
from triforce.decoding.full_tier import PREFILL_CHUNK, PREFILL_GROUP, FullTier, Queries
from triforce.decoding.graph_runner import captures_held, runner_mode
from triforce.decoding.hooks import EngineHooks
from triforce.decoding.logprobs import LogprobRecorder
from triforce.decoding.policy import SpeculationPolicy, SparseUpkeep
from triforce.decoding.sampling import penalize, probabilities
from triforce.decoding.observers import Round
from triforce.decoding.statistics import GenerationResult, LevelStats
from triforce.decoding.tiers import build_levels, prepare_graphs
from triforce.decoding.verification import Draws, Verdict, verify_greedy
from triforce.errors import UserError
from triforce.model.loading import LoadedModel


class Engine:
    def __init__(self, lm: LoadedModel, spec: SpecParams, max_len: int, draft=None, kv_cache=None,
                 prefill_chunk: int = PREFILL_CHUNK, graphs: str = "auto", hooks: EngineHooks = EngineHooks(),
                 prefill_group: int = PREFILL_GROUP, speculate_from: int = 0, draft_ahead: bool = False,
                 full: FullTier | None = None):
        """draft: a Draft, a loaded model, 'lookup', 'none' or None (see decoding.draft).
        kv_cache: the full cache (see triforce.app.plan_and_cache); default resident. full: another
        engine's full tier to decode instead (one cache, two methods: a server's row alone or in a
        batch). prefill_chunk, prefill_group: a memory plan's prefill sizes. graphs: how drafting
        tiers run (auto: CUDA graphs on CUDA, else eager; off: eager; static: the graphs' fixed-shape
        path uncaptured, see decoding.graph_runner). speculate_from: below this sequence length the
        full tier checks no drafts (auto's switch-over). draft_ahead: the tier below the full one
        drafts the next cycle while the full tier verifies (triforce.decoding.draft_ahead)."""
        if spec.method == AUTO:
            raise ValueError("method auto is chosen when a run is planned (Runtime.plan); an engine needs the method")
        self.lm, self.spec, self.hooks, self.speculate_from = lm, spec, hooks, speculate_from
        self.runner_mode = runner_mode(graphs, lm.device)
        self.full = full or FullTier(lm, max_len, kv_cache, prefill_chunk, prefill_group, self.runner_mode, hooks.agree_ok)
        # an engine built in code ignores a draft its method does not use (the CLI refuses one)
        draft = resolve_draft(draft, spec, refuse_unused=False)
        self.levels = build_levels(lm, spec, draft, self.full, self.runner_mode, hooks.agree_ok)
        self.sparse_tiers = [t for t in self.levels if t.kind == "sparse"]
        ahead = wanted(draft_ahead, self.levels, hooks.agree is not None, hooks.sync_counter is not None)
        self.ahead = AheadRunner(lm.device) if ahead else None
        self._carried = None  # drafts made during the last verify
        self.policy = SpeculationPolicy(spec, hooks.gamma2_controller if len(self.levels) > 1 else None, ahead,
                                        hooks.gamma1_controller if len(self.levels) > 2 else None)
        self.upkeep = SparseUpkeep(self.sparse_tiers, self.full, self.policy, spec.selection_window)
        # drafts each verifying level checks per round: the full tier gamma2, a middle one gamma1
        self.gammas = [0] + [spec.gamma1] * (len(self.levels) - 2) + [spec.gamma2]
        self.seq: list[int] = []
        self.params = SamplingParams()
        self.draws: Draws | None = None  # a sampled request's randomness, per generate
        self.stats, self.rounds = [LevelStats() for _ in self.levels], []  # rounds: (tier, proposed, accepted)
        self.gate = hooks.speculation_gate
        self.ahead_tally = AheadTally()
        # what hears every round (decoding.observers); a generate call may add its logprobs
        self.observers = [o for o in (self.gate, self.ahead_tally if ahead else None) if o is not None]
        self._observers = self.observers
        self._passes: list[tuple[str, int]] = []  # (kind, tokens fed) of the round's passes, for the gate
        prepare_graphs(self.levels, self.spec)  # before any request: captured at its first token, they stalled it

    @property
    def max_len(self) -> int:
        return self.full.max_len

    def describe(self) -> str:
        return " -> ".join(t.name for t in self.levels)

    # ---- input -------------------------------------------------------------------------
    def tokens_to_prefill(self, ids: list[int]) -> int:
        """How many tokens set_sequence(ids) will prefill (the rest is reused from the cache)."""
        return len(ids) - 1 - self.full.kept(ids[:-1], self.spec.selection_window if self.sparse_tiers else 0)

    def set_sequence(self, ids: list[int], progress: Callable[[int], None] | None = None) -> int:
        """Make the sequence `ids` (the last token pending), reusing cached KV where it can.
        Returns the number of tokens prefilled into the full cache."""
        if not ids:
            raise UserError("empty input")
        if len(ids) > self.max_len:
            raise UserError(f"input of {len(ids)} tokens does not fit the {self.max_len}-token context")
        self.seq, self._carried = list(ids), None
        window = self.spec.selection_window if self.sparse_tiers else 0
        prefilled, queries = self.full.cover(ids[:-1], progress, record_queries=window)
        self.upkeep.start(queries)
        for tier in self.levels[:-1]:
            tier.start(self.seq)  # a draft model covers it with its streaming cache
        return prefilled

    # ---- decoding ----------------------------------------------------------------------
    def generate(self, max_new_tokens: int, params: SamplingParams, stop_ids: frozenset[int] = frozenset(),
                 on_token: Callable[[int], None] | None = None, generator: torch.Generator | None = None,
                 logprobs: LogprobRecorder | None = None,
                 stop_requested: Callable[[], bool] | None = None) -> GenerationResult:
        """Up to max_new_tokens after the sequence set_sequence made, a round (step) at a time, until
        a stop token, the length, the context's end or stop_requested() (asked before each round;
        Ctrl-C drops the round under way, the tokens before it stay). logprobs: the emitted tokens'
        log-probabilities go there."""
        if not self.seq:
            raise RuntimeError("generate needs input: call set_sequence first")
        self._begin(params, generator, logprobs)
        before, started, out = self._counters(), time.perf_counter(), []
        stopped_by, kept = "length", len(self.seq)
        counter = self.hooks.sync_counter
        with counter.recording(self.lm.device) if counter is not None else nullcontext():
            try:
                while len(out) < max_new_tokens and stopped_by == "length":
                    limit = min(max_new_tokens - len(out), self.max_len - len(self.seq) + 1)
                    if limit <= 0 or (stop_requested is not None and stop_requested()):
                        stopped_by = "context" if limit <= 0 else "interrupt"
                        break
                    new, stopped = self.step(limit, stop_ids, first=not out)
                    out += new
                    kept = len(self.seq)
                    stopped_by = "eos" if stopped else stopped_by
                    for token in new if on_token is not None else ():
                        on_token(token)
            except KeyboardInterrupt:
                self._truncate_all(kept - 1)  # the round under way is dropped; committed tokens stay
                del self.seq[kept:]
                stopped_by = "interrupt"
        return GenerationResult(out, stopped_by, time.perf_counter() - started, self.summary(before, len(out)))

    def step(self, limit: int, stop_ids: frozenset[int] = frozenset(), first: bool = False) -> tuple[list[int], bool]:
        """One round: plan it, run the checks from the bottom tier up, commit what the full tier
        kept. Returns the tokens it emitted (at most `limit`) and whether a stop token ended them."""
        plan = self._plan(limit, first)
        if len(self.levels) == 1:
            self._propose_bottom(1)
            queries = None
        else:
            queries = self._round(len(self.levels) - 1, limit)[1]
        return self._commit(plan, queries, stop_ids)

    def _begin(self, params: SamplingParams, generator, logprobs) -> None:
        self.params, self.draws = params, Draws(params, self.lm.device, generator)
        self.stats, self.rounds, self._carried = [LevelStats() for _ in self.levels], [], None
        self._observers = self.observers + ([logprobs] if logprobs is not None else [])
        for observer in self._observers:
            observer.started(params)
        if self.gate is not None:  # a seed's draws by position repeat whatever the clock says; others must not
            self.gate.price_rounds(self.draws.follow_rounds)

    def _plan(self, limit: int, first: bool) -> Round:
        base = len(self.seq)
        plan = Round(base, limit, first, base >= self.speculate_from, self.policy.gamma2, time.perf_counter())
        for observer in self._observers:
            observer.planning(plan)
        if self.gate is not None and self.hooks.agree is not None:  # rank 0's timings decide for every rank
            plan.speculate = bool(self.hooks.agree([int(plan.speculate)])[0])
        with self._phase("cache upkeep"):
            self.upkeep.make_room(catch_up=base - 1 if plan.speculate else None)
            self.full.prepare_verify()  # offloaded KV starts streaming while tiers below draft
        self.gammas[-1] = plan.gamma2 if plan.speculate else 0
        self._passes = plan.passes
        return plan

    def _commit(self, plan: Round, queries: Queries | None, stop_ids: frozenset[int]) -> tuple[list[int], bool]:
        new = self.seq[plan.base:]
        stop_at = next((i for i, t in enumerate(new) if t in stop_ids), None)
        if stop_at is not None:
            self.stats[-1].emitted -= len(new) - (stop_at + 1)
            del self.seq[plan.base + stop_at + 1:], new[stop_at + 1:]
            self._truncate_all(len(self.seq) - 1)
        with self._phase("cache upkeep"):
            self.upkeep.after_full_verify(plan.base - 1, len(self.seq) - 1, queries, drafted=plan.speculate)
        self.policy.next_gamma2()  # the next round's plan reads policy.gamma2
        plan.emitted, plan.drafted = len(new), plan.speculate and len(self.levels) > 1
        plan.seconds = time.perf_counter() - plan.started
        for observer in self._observers:
            observer.committed(plan)
        return new, stop_at is not None

    def _phase(self, name: str):
        counter = self.hooks.sync_counter
        return counter.phase(name) if counter is not None else nullcontext()

    def _counters(self) -> tuple[dict, int]:
        return {t.name: t.time_s for t in self.levels}, sum(t.rebuilds for t in self.sparse_tiers)

    def summary(self, before: tuple[dict, int], tokens: int) -> dict:
        """The statistics of the generate call that began when tier times and rebuilds were
        `before` (_counters) and emitted `tokens`."""
        times_before, rebuilds_before = before
        top = self.stats[-1]
        checked = [(self.levels[i].name, s) for i, s in enumerate(self.stats) if i > 0]
        stats = {
            "tiers": self.describe(),
            "acceptance_rates": {name: round(s.accepted / s.proposed, 4) for name, s in checked if s.proposed},
            "proposed": {name: s.proposed for name, s in checked},
            "accepted": {name: s.accepted for name, s in checked},
            "full_verifies": top.rounds,
            "gamma2": self.gammas[-1] if len(self.levels) > 1 else None,
            "mean_tokens_per_full_verify": round(top.emitted / top.rounds, 4) if top.rounds else None,
            "tier_time_s": {t.name: round(t.time_s - times_before[t.name], 4) for t in self.levels},
            # during this call (the rebuild at set_sequence is not counted)
            "rebuilds": sum(t.rebuilds for t in self.sparse_tiers) - rebuilds_before,
        }
        for observer in self._observers:
            stats.update(observer.report())
        if self.hooks.sync_counter is not None:
            stats["host_syncs"] = self.hooks.sync_counter.report(tokens)
        return stats

    def _round(self, level: int, limit: int) -> tuple[list[torch.Tensor | None], Queries | None]:
        """One check at `level` (level 0: one sampled token). Appends the emitted tokens to seq;
        returns the distribution each was drawn from (None when greedy or deterministic) and, for
        the full tier, the verify pass's queries (when a sparse tier needs them)."""
        if level == 0:
            return self._propose_bottom(1), None
        tier = self.levels[level]
        base = len(self.seq)
        checks_tier0 = level == 1 and len(self.levels) > 2  # the retrieval tier checking tier 0's drafts
        want = min(self.policy.next_gamma1() if checks_tier0 else self.gammas[level], limit - 1)
        draft_dists = self._carried_drafts(want) if tier is self.full else []
        if want > len(draft_dists):
            draft_dists += self._propose(level - 1, want - len(draft_dists))
        drafts = self.seq[base:]
        queries, ahead = None, None
        self._passes.append((tier.kind, len(self.seq) - tier.covered()))
        with self._phase(f"{tier.name} forward"):
            if tier is not self.full:
                logits = tier.logits(self.seq)
            elif self.ahead is not None and drafts and limit - len(drafts) > 2:
                verify = partial(tier.verify, list(self.seq), bool(self.sparse_tiers))
                with captures_held(self.levels):  # the verify issues work on another thread meanwhile
                    (logits, queries), ahead = self.ahead.run(verify, partial(self._draft_ahead, level - 1,
                                                                              limit - len(drafts) - 1))
            else:
                logits, queries = tier.verify(self.seq, record_queries=bool(self.sparse_tiers))
        rows = penalize(logits[-(len(drafts) + 1):], self.seq, self.params)  # each row's own context
        with self._phase(f"{tier.name} verify"):
            if self.hooks.replay is not None:
                verdict, probs = self.hooks.replay.verdict(tier.name, drafts, rows), None
            elif self.params.greedy:
                verdict, probs = verify_greedy(drafts, rows), None
            else:
                probs = probabilities(rows, self.params)
                verdict = self.sampled_verdict(tier.name, drafts, draft_dists, probs, base)
            if self.hooks.agree is not None:
                verdict = Verdict(*self.hooks.agree([verdict.accepted, verdict.token]))
        del self.seq[base + verdict.accepted:]
        self.seq.append(verdict.token)
        if tier is self.full:
            for observer in self._observers:
                observer.full_logits(logits[len(logits) - len(drafts) - 1:][:verdict.accepted + 1], self.seq[base:])
        for lower in self.levels[:level + 1]:
            lower.truncate(len(self.seq) - 1)
        self.rounds.append((tier.name, len(drafts), verdict.accepted))
        self.stats[level].add(len(drafts), verdict.accepted)
        if checks_tier0:
            self.policy.tier0_checked(len(drafts), verdict.accepted)
        if tier is self.full:
            self.policy.full_verified(len(drafts), verdict.accepted)
            if ahead is not None:
                self._carried = ahead.follow_on(verdict.accepted == len(drafts), verdict.token)
                self.ahead_tally.rounds += 1
                self.ahead_tally.kept += self._carried is not None
        return [None if probs is None else probs[i] for i in range(verdict.accepted + 1)], queries

    def _propose(self, level: int, count: int) -> list[torch.Tensor | None]:
        """Append about `count` tokens drawn from level `level`'s distribution (a lookup drafter
        may find fewer); returns their distributions."""
        if level == 0:
            return self._propose_bottom(count)
        dists: list = []
        while len(dists) < count:
            dists += self._round(level, count - len(dists))[0]
        return dists

    def _carried_drafts(self, want: int) -> list[torch.Tensor | None]:
        """Append up to `want` of the drafts made during the last verify; returns their
        distributions. What is not taken now is dropped."""
        carried, self._carried = self._carried, None
        if carried is None or want <= 0:
            return []
        self.seq.extend(carried.tokens[:want])
        self._passes += carried.passes  # the passes that made them count for the round that uses them
        return list(carried.dists[:want])

    def _draft_ahead(self, level: int, room: int) -> Ahead | None:
        """Propose at `level` the full tier's bonus token and the next cycle's drafts, as if the verify
        under way accepts every draft; seq is left as it was. room: tokens still wanted after it."""
        count = min(self.policy.gamma2 + 1, room, self.max_len - len(self.seq))
        if count < 2:
            return None
        start, passes = len(self.seq), self._passes
        self._passes = []
        try:
            dists = self._propose(level, count)
            return Ahead(self.seq[start:], dists, self._passes)
        finally:
            del self.seq[start:]
            self._passes = passes

    def _propose_bottom(self, count: int) -> list[torch.Tensor | None]:
        tier = self.levels[0]
        if tier.kind == "lookup":
            tokens = tier.propose(self.seq, count)
            self.seq.extend(tokens)
            return [None] * len(tokens)
        dists = []
        for _ in range(count):
            self._passes.append((tier.kind, len(self.seq) - tier.covered()))
            with self._phase(f"{tier.name} forward"):
                logits = penalize(raw := tier.logits(self.seq)[-1:], self.seq, self.params)[0]
            with self._phase(f"{tier.name} sample"):
                dist = None if self.params.greedy else probabilities(logits, self.params)
                if dist is None:  # the target's via the verifier: its finiteness check rides on the read
                    token = verify_greedy([], logits[None]).token if tier is self.full else int(logits.argmax())
                else:
                    token = self.draws.token(dist, len(self.seq))
                if self.hooks.agree is not None:
                    token = self.hooks.agree([token])[0]
            self.seq.append(token)
            dists.append(dist)
            if tier is self.full:
                for observer in self._observers:
                    observer.full_logits(raw, [token])
        if tier is self.full:
            self.stats[0].rounds += count
            self.stats[0].emitted += count
        return dists

    def sampled_verdict(self, tier_name: str, drafts: list[int], draft_dists: list, probs, position: int) -> Verdict:
        """`drafts` (from sequence position `position` on) judged against tier `tier_name`'s probabilities."""
        return self.draws.verdict(drafts, draft_dists, probs, position)

    # ---- cache upkeep ------------------------------------------------------------------
    def _truncate_all(self, length: int) -> None:
        self._carried = None
        for tier in self.levels:
            tier.truncate(length)

