"""--method auto, online: decode as ar while speculation turns out slower than ar (the offline
half, the cost model's pick before the first token, is triforce.plan.method_choice).

The a priori choice assumes an acceptance; the text decides the real one (prose that never
repeats itself is drafted far worse than a document the answer quotes). So the engine keeps
score: the time of each full verify's round (drafting and verify) per token it emitted, over the
last GATE_WINDOW speculative rounds, against the time of an ar step. When speculation loses, the
engine decodes as ar for a hold of tokens, then tries speculation again in probes, scored together
after each one: the first drafts PROBE_GAMMA; while their score wins, a probe whose drafts all
passed doubles the next one's (one that stopped short keeps them: more would mostly be rejected),
until one checks the full gamma2 and wins; a losing score doubles the hold. A hold is long enough
that what a losing probe cost beyond ar's steps stays under PROBE_SHARE of it.

Times are measured (the cost model's absolute times can be off by 2-3x on a CPU its profile was
not tuned on); the cost
model only carries an ar step's measured time to the current length (an ar step at 12K costs more
than the one measured at 8K). The first ar steps calibrate the reference. `cost` turns a round
into milliseconds: wall time by default; tests price the passes instead, so decisions repeat."""
from __future__ import annotations

import math
import statistics
from collections import deque
from typing import Callable

from triforce.decoding.observers import Observer, Round

GATE_WINDOW = 4        # speculative rounds scored together
GATE_HOLD = (16, 512)  # tokens decoded as ar before speculation is tried again: the first hold, the longest
CALIBRATION_STEPS = 4  # ar steps that measure the reference before the first speculative round
PROBE_HOLD = 32        # where the cost model expects ar to win: ar steps before the first try of speculation
AR_SAMPLES = 8         # recent ar steps whose median is the reference
# the most of the time losing probes may take: a probe that cost 11 ar steps for one token (26K on
# a CPU, sampled) came back after 16 tokens, and 64-token answers ran at 0.81x ar (issue 60)
PROBE_SHARE = 0.1
# the drafts a first probe checks: probes lose more often than not, and on a CPU each draft costs a
# retrieval pass and a verify row (26K sampled, Zen 3: a probe of 4 took 4.3 ar steps, of 2 2.9).
# Doubling from there: one lucky small probe that brought back gamma2 8 on prose it could not draft
# lost four 9-token verifies (Xeon, 26K sampled: 0.82x; bench/RESULTS.md)
PROBE_GAMMA = 1

Passes = list[tuple[str, int]]  # (kind, tokens fed) of each forward pass of a round


def wall_ms(passes: Passes, seconds: float, length: int) -> float:
    return seconds * 1000.0


class SpeculationGate(Observer):
    def __init__(self, prices=None, speculate_from: int = 0, cost: Callable[[Passes, float, int], float] = wall_ms,
                 window: int = GATE_WINDOW, hold: tuple[int, int] = GATE_HOLD, calibration: int = CALIBRATION_STEPS,
                 ar_first: int = 0):
        """prices: plan.cost_model.RoundPrices (scales the ar reference with the length; None:
        no scaling). speculate_from: below this length always ar (the a priori switch-over).
        ar_first: decode this many tokens as ar before the first speculative round, which then
        decides alone (where the cost model expects ar to win, speculation is only tried: text
        that repeats itself, a quoted document, still gets its speed-up)."""
        self.prices, self.speculate_from, self.cost = prices, speculate_from, cost
        self._timed = cost  # how rounds are scored unless price_rounds says otherwise
        self.first_hold, self.max_hold = hold
        self._hold = self.first_hold
        self._rounds: deque[tuple[float, int]] = deque(maxlen=window)  # (ms, tokens emitted)
        self._ar: deque[tuple[float, int]] = deque(maxlen=AR_SAMPLES)  # (ms of one ar step, its length)
        self._calibration = calibration
        self._ar_until = 0     # decode as ar while the sequence is shorter than this
        self._probing = ar_first > 0  # the next speculative rounds are probes
        self._probe_gamma = PROBE_GAMMA  # the drafts the next probe checks at most
        self._full_gamma = 0  # the drafts the engine asked for last
        self._ar_first = ar_first     # set against the first length seen
        self.fallbacks = 0     # times speculation was found slower and ar took over
        self.ar_tokens = 0     # tokens emitted by ar steps from speculate_from on

    def price_rounds(self, on: bool) -> None:
        """on: decide by the cost model's prices of the passes, not wall time, so a sampled answer
        whose draws follow the rounds (a seed beside a generator of its own) repeats. A plain
        seed's draws depend on the position alone (sampling.PositionNoise): its rounds are timed,
        as the prices under-price a CPU's probes (bench/RESULTS.md). Switching clears what was
        scored the other way."""
        cost = self._priced if on and self.prices is not None else self._timed
        if cost != self.cost:
            self._rounds.clear()
            self._ar.clear()
        self.cost = cost

    # ---- as the engine's observer -------------------------------------------------------
    def planning(self, plan: Round) -> None:
        plan.speculate = plan.speculate and self.speculate(plan.base, plan.first)
        plan.gamma2 = self.gamma(plan.gamma2)

    def committed(self, plan: Round) -> None:
        self.round_done(plan.base, plan.passes, plan.emitted, plan.drafted, plan.seconds)

    def report(self) -> dict:
        return {"auto_fallbacks": self.fallbacks, "auto_ar_tokens": self.ar_tokens}

    def _priced(self, passes: Passes, seconds: float, length: int) -> float:
        return sum(self.prices.pass_ms(kind, tokens, length) for kind, tokens in passes)

    @property
    def probing(self) -> bool:
        """Whether the next speculative round is a probe (few drafts, scored as soon as it ends)."""
        return self._probing

    def gamma(self, gamma2: int) -> int:
        """The drafts a speculative round checks: a probe's fewer, from PROBE_GAMMA up."""
        self._full_gamma = gamma2
        return min(gamma2, self._probe_gamma) if self._probing else gamma2

    def speculate(self, length: int, first: bool = False) -> bool:
        """Whether the round at `length` checks drafts. first: the round brings a request's first
        token, an ar step's where that takes under half a round (a chat's follow-up at 16K waited
        0.21 s for a round where an ar step takes 0.02, CPU). Where a step costs near a round (an
        offloaded GPU's full pass) the round stays: the first token would come a little sooner
        and every later one a step later."""
        if self._ar_first:
            self._ar_until, self._ar_first = length + self._ar_first, 0
        if length < self.speculate_from:
            return False
        if first and self._rounds and 2 * self.ar_ms(length) < statistics.median(ms for ms, _ in self._rounds):
            return False
        return len(self._ar) >= self._calibration and length >= self._ar_until

    def round_done(self, length: int, passes: Passes, emitted: int, speculated: bool, seconds: float) -> None:
        """A full verify's round at sequence length `length`: its passes, the tokens it emitted,
        whether it checked drafts, and its wall time."""
        ms = self.cost(passes, seconds, length)
        if not speculated:
            if length >= self.speculate_from:
                self.ar_tokens += emitted
            if emitted == 1:  # an ar step cut short by the end is no sample
                self._ar.append((ms, length))
            return
        self._rounds.append((ms, emitted))
        if not self._probing and len(self._rounds) < self._rounds.maxlen:
            return  # probes are scored after each one, other rounds once the window is full
        spec_ms = sum(ms for ms, _ in self._rounds) / sum(n for _, n in self._rounds)
        ar_ms = self.ar_ms(length)
        if spec_ms > ar_ms:
            # a probe is a losing round: its cost beyond ar's steps must be a small share of the hold
            lost = (spec_ms - ar_ms) * sum(n for _, n in self._rounds) / len(self._rounds)
            hold = min(max(self._hold, math.ceil(lost / (ar_ms * PROBE_SHARE))), self.max_hold)
            self._ar_until = length + hold
            self._hold = min(2 * hold, self.max_hold)
            self._rounds.clear()
            self._probing, self._probe_gamma = True, PROBE_GAMMA
            self.fallbacks += 1
        elif self._probing and self._probe_gamma >= self._full_gamma:  # a probe of full drafts won
            self._probing, self._hold, self._probe_gamma = False, self.first_hold, PROBE_GAMMA
        elif self._probing and emitted > self._probe_gamma:  # all its drafts passed: try twice as many
            # (doubling after any win, a probe of 2 whose first draft failed was followed by one of 4:
            # 406 ms for 2 tokens beside ar steps of 115, 26K seeded, Zen 3)
            self._probe_gamma *= 2

    def ar_ms(self, length: int) -> float:
        """An ar step's time at `length`: the median of the recent ar steps, each carried from the
        length it ran at by the cost model's ratio."""
        if not self._ar:
            return float("inf")
        if self.prices is None:
            return statistics.median(ms for ms, _ in self._ar)
        now = self.prices.ar_ms(length)
        return statistics.median(ms * now / self.prices.ar_ms(then) for ms, then in self._ar)
