"""Predicted milliseconds per token, following MagicDec's formulation:

    per-token time = (T_verify(gamma2) + drafting time per verify) / expected tokens per verify

A forward pass costs its projections (the larger of reading the weights at the device's bandwidth
and their arithmetic at its FLOP rate), its attention (the larger of reading the KV at the
attention kernel's rate and its arithmetic), and a fixed overhead per layer (kernel launches,
Python); a full verify also moves the offloaded KV over PCIe. Acceptance is treated as independent per token with rate alpha, so a check of gamma
drafts yields (1 - alpha^(gamma+1)) / (1 - alpha) tokens on average."""
from __future__ import annotations

from dataclasses import dataclass, replace

from triforce.offload.errors import OffloadError
from triforce.offload.hybrid import HybridRates

# at most 15 drafts: a verify pass of <= 16 tokens stays within the CPU kernels' small-rows limit,
# where each token is computed as a one-token step would be (bfloat16 greedy equals AR; README)
GAMMA2_RANGE = range(1, 16)
GAMMA1_RANGE = range(1, 9)
# Predictions this close count as a tie, broken toward longer speculation: every check also costs
# engine bookkeeping the model leaves out, so fewer checks per token win a near-tie (measured on CPU:
# gamma2 8 beat gamma2 4 by 19% where the model had them 1% apart; bench/RESULTS.md).
TIE_FRACTION = 0.03


@dataclass(frozen=True)
class Acceptance:
    """full: how often the full-cache target accepts a retrieval-tier token; retrieval: how often
    the retrieval tier accepts a tier-0 draft. Defaults are assumptions unless measured."""
    full: float = 0.9
    retrieval: float = 0.8
    measured: bool = False

    def __post_init__(self):
        for name in ("full", "retrieval"):
            if not 0 <= getattr(self, name) <= 1:
                raise OffloadError(f"acceptance '{name}' must be in [0, 1], got {getattr(self, name)}")


def expected_tokens(alpha: float, gamma: int) -> float:
    """Tokens emitted by one check of `gamma` drafts (accepted prefix + the correction/bonus)."""
    if alpha >= 1:
        return gamma + 1.0
    return (1 - alpha ** (gamma + 1)) / (1 - alpha)


def rate_from_fraction(fraction: float, gamma: int) -> float:
    """The per-token acceptance rate alpha (the model's) under which checks of `gamma` drafts keep
    `fraction` of them on average: what a run reports (accepted / drafted) is that fraction, not
    alpha (a check stops at its first rejection, so 0.68 of 8 drafts kept means alpha ~0.91)."""
    if not 0 <= fraction <= 1 or gamma < 1:
        raise OffloadError(f"an accepted fraction must be in [0, 1] and gamma >= 1, got {fraction}, {gamma}")
    low, high = 0.0, 1.0
    for _ in range(60):  # the fraction kept rises with alpha: bisect
        mid = (low + high) / 2
        if (expected_tokens(mid, gamma) - 1) / gamma < fraction:
            low = mid
        else:
            high = mid
    return round((low + high) / 2, 4)


@dataclass(frozen=True)
class Hardware:
    hbm_gbps: float                       # weights read by a matrix-vector product
    h2d_gbps: float
    compute_tflops: float | None = None   # decode-shaped (few-row) matmuls; None: memory-bound only
    layer_overhead_us: float = 0.0        # fixed cost per layer per forward pass
    attention_gbps: float | None = None   # KV read by the attention kernel; None: hbm_gbps
    attention_tflops: float | None = None  # attention's arithmetic (a verify pass); None: compute_tflops
    cpu_attention_gbps: float | None = None   # host KV attended in place by the CPU (hybrid); None: streamed only
    cpu_attention_tflops: float | None = None
    # the block kernels' rates per weight format, ((format, rate), ...): block bytes/s with one row,
    # arithmetic with a verify pass's rows; a format absent: the float rates above
    block_gbps: tuple = ()
    block_tflops: tuple = ()

    def weight_rates(self, weights: str | None) -> tuple[float, float | None]:
        """(GB/s, TFLOP/s) of the target's projections in `weights` ("q4_1/q8_0" for a mix: the
        slower of each; None: floats)."""
        gbps, tflops = dict(self.block_gbps), dict(self.block_tflops)
        formats = weights.split("/") if weights else []
        if not formats or not all(f in gbps and f in tflops for f in formats):
            return self.hbm_gbps, self.compute_tflops
        return min(gbps[f] for f in formats), min(tflops[f] for f in formats)


@dataclass(frozen=True)
class StepCosts:
    """What one forward pass of each tier reads and computes (per GPU)."""
    num_layers: int
    weights_bytes: int
    resident_kv_bytes: int
    host_kv_bytes: int             # crosses this GPU's PCIe link every full verify
    retrieval_kv_bytes: int
    draft_bytes: int               # draft weights plus its cache; 0 for prompt lookup
    draft_layers: int
    flops_per_token: float         # 2 x parameters
    draft_flops_per_token: float
    attention_flops_per_key: float  # per token and key: 4 x layers x heads x head_dim
    context: int
    budget: int
    kv_group: int = 1               # query heads per KV head
    element_bytes: int = 2          # of the KV
    weights_format: str | None = None  # the target's matrices as blocks (Hardware.weight_rates); None: floats


def _forward_ms(hw: Hardware, weight_bytes: float, weight_flops: float, kv_bytes: float, attention_flops: float,
                layers: int, weights: str | None = None) -> float:
    rate = hw.compute_tflops * 1e9 if hw.compute_tflops else float("inf")  # FLOPs per ms
    attention_rate = hw.attention_tflops * 1e9 if hw.attention_tflops else rate
    weights_gbps, weights_tflops = hw.weight_rates(weights)
    weights_rate = weights_tflops * 1e9 if weights_tflops else float("inf")
    projections = max(weight_bytes / (weights_gbps * 1e6), weight_flops / weights_rate)
    attention = max(kv_bytes / ((hw.attention_gbps or hw.hbm_gbps) * 1e6), attention_flops / attention_rate)
    return projections + attention + layers * hw.layer_overhead_us / 1000


def host_kv_ms(c: StepCosts, hw: Hardware, tokens: int, rows: int = 1) -> float:
    """The host KV's part of a full pass of `tokens` new tokens: over PCIe alone, or hybrid (the
    CPU attending its share in place while the link streams the rest) when the hardware has CPU
    attention rates."""
    host = rows * c.host_kv_bytes
    rates = HybridRates.of(hw, c)
    return rates.host_ms(host, tokens) if rates is not None else host / (hw.h2d_gbps * 1e6)


# A pass over `rows` sequences of a batch (triforce.decoding.lockstep) reads the weights once and
# each row's own KV: arithmetic and KV scale with the rows, weights do not (MagicDec's analysis).
def full_verify_ms(c: StepCosts, hw: Hardware, tokens: int, rows: int = 1) -> float:
    return host_kv_ms(c, hw, tokens, rows) + _forward_ms(
        hw, c.weights_bytes, rows * tokens * c.flops_per_token, rows * c.resident_kv_bytes,
        rows * tokens * c.attention_flops_per_key * c.context, c.num_layers, c.weights_format)


def tier1_ms(c: StepCosts, hw: Hardware, tokens: int, rows: int = 1) -> float:
    return _forward_ms(hw, c.weights_bytes, rows * tokens * c.flops_per_token, rows * c.retrieval_kv_bytes,
                       rows * tokens * c.attention_flops_per_key * c.budget, c.num_layers, c.weights_format)


def tier0_ms(c: StepCosts, hw: Hardware, rows: int = 1) -> float:
    if not c.draft_bytes:
        return 0.0
    return _forward_ms(hw, c.draft_bytes, rows * c.draft_flops_per_token, 0, 0, c.draft_layers)


def triforce_ms_per_token(c: StepCosts, hw: Hardware, acceptance: Acceptance, gamma1: int, gamma2: int,
                          has_tier0: bool, rows: int = 1) -> dict:
    """Predicted ms/token of the three-tier loop (two tiers when has_tier0 is False), per
    sequence of a batch of `rows` (the batch makes rows times as many tokens in that time)."""
    per_verify = expected_tokens(acceptance.full, gamma2)
    if has_tier0:
        per_check = expected_tokens(acceptance.retrieval, gamma1)
        checks = gamma2 / per_check
        drafting = checks * (tier1_ms(c, hw, gamma1 + 1, rows) + gamma1 * tier0_ms(c, hw, rows))
    else:
        drafting = gamma2 * tier1_ms(c, hw, 1, rows)
    verify = full_verify_ms(c, hw, gamma2 + 1, rows)
    return {"triforce_ms_per_token": (verify + drafting) / per_verify, "full_verify_ms": verify,
            "drafting_ms_per_verify": drafting, "expected_tokens_per_full_verify": per_verify}


def drafted_ahead_ms_per_token(part: dict, full_rate: float, gamma2: int) -> dict:
    """triforce_ms_per_token's `part` when the tier below drafts the next cycle during each verify
    (triforce.decoding.draft_ahead): gamma2 + 1 tokens overlapped with the verify, kept when the
    verify accepts all gamma2 drafts and its bonus token is the guessed one (probability
    full_rate ** (gamma2 + 1) in the model's independent acceptance), else drafted again after it."""
    drafting, verify = part["drafting_ms_per_verify"], part["full_verify_ms"]
    kept = full_rate ** (gamma2 + 1)
    cycle = max(verify, drafting * (gamma2 + 1) / gamma2) + (1 - kept) * drafting
    return {"ms_per_token": cycle / part["expected_tokens_per_full_verify"], "kept_share": kept}


def static_tree_part(c: StepCosts, hw: Hardware, part: dict, full_rate: float, gamma2: int, hit: float,
                     rows: int = 1) -> dict:
    """triforce_ms_per_token's `part` with a static tree for the full verify, not built (issue 41
    item 6): beside each of the gamma2 drafts one alternative token (the tier below's runner-up, or
    a second draw from its distribution) is verified in the same pass, 2 * gamma2 + 1 queries. Where
    the chain breaks (probability 1 - full_rate ** gamma2) the alternative is taken with probability
    `hit` and its own row gives one more token. `hit` measured once: bench/history/2026-11-26-natural-text.md."""
    verify = full_verify_ms(c, hw, 2 * gamma2 + 1, rows)
    tokens = part["expected_tokens_per_full_verify"] + (1 - full_rate ** gamma2) * hit
    return {"triforce_ms_per_token": (verify + part["drafting_ms_per_verify"]) / tokens, "full_verify_ms": verify,
            "drafting_ms_per_verify": part["drafting_ms_per_verify"], "expected_tokens_per_full_verify": tokens}


def naive_ms_per_token(c: StepCosts, hw: Hardware, alpha: float, gamma: int) -> float:
    """Predicted ms/token of tier-0 drafts checked by the full cache directly (--method naive),
    each accepted with rate alpha."""
    return (gamma * tier0_ms(c, hw) + full_verify_ms(c, hw, gamma + 1)) / expected_tokens(alpha, gamma)


def costs_at(c: StepCosts, resident_tokens: int, length: int) -> StepCosts:
    """The same run's step costs once its sequence is `length` tokens long: the first
    resident_tokens of the KV on the device, the rest crossing PCIe at each full verify."""
    per_token = (c.resident_kv_bytes + c.host_kv_bytes) / max(c.context, 1)
    resident = min(length, resident_tokens)
    return replace(c, resident_kv_bytes=int(resident * per_token), host_kv_bytes=int((length - resident) * per_token),
                   context=length)


def best_gammas(c: StepCosts, hw: Hardware, acceptance: Acceptance, has_tier0: bool,
                gamma1_range=GAMMA1_RANGE, gamma2_range=GAMMA2_RANGE, rows: int = 1) -> tuple[int, int, float]:
    """(gamma1, gamma2, ms/token): the lowest predicted time, near-ties going to the longest gammas."""
    options = []
    for g1 in (gamma1_range if has_tier0 else tuple(gamma1_range)[:1]):  # no tier 0: gamma1 costs nothing
        for g2 in gamma2_range:
            ms = triforce_ms_per_token(c, hw, acceptance, g1, g2, has_tier0, rows)["triforce_ms_per_token"]
            options.append((g1, g2, ms))
    fastest = min(ms for _, _, ms in options)
    return max((o for o in options if o[2] <= fastest * (1 + TIE_FRACTION)), key=lambda o: (o[1], o[0]))


def gamma2_bounds(c: StepCosts, hw: Hardware, acceptance: Acceptance, gamma1: int, has_tier0: bool,
                  low: float = 0.5, high: float = 0.99) -> tuple[int, int]:
    """The gamma2 the model would pick if the full tier's acceptance ran anywhere from `low` to
    `high`: the range the engine may adapt within as it observes the real rate."""
    picks = [best_gammas(c, hw, Acceptance(a, acceptance.retrieval), has_tier0, (gamma1,))[1] for a in (low, high)]
    return min(picks), max(picks)


class Gamma2Controller:
    """Picks gamma2 for the observed acceptance of the full tier, within fixed bounds."""

    def __init__(self, costs: StepCosts, hw: Hardware, acceptance: Acceptance, gamma1: int, has_tier0: bool,
                 bounds: tuple[int, int]):
        self.costs, self.hw, self.acceptance = costs, hw, acceptance
        self.gamma1, self.has_tier0, self.bounds = gamma1, has_tier0, bounds

    def choose(self, observed_full: float) -> int:
        alpha = min(max(observed_full, 0.0), 0.999)
        acc = Acceptance(alpha, self.acceptance.retrieval)
        lo, hi = self.bounds
        return best_gammas(self.costs, self.hw, acc, self.has_tier0, (self.gamma1,), range(lo, hi + 1))[1]


class Gamma1Controller:
    """Picks how many tier-0 drafts the retrieval tier checks at a time, from none (it drafts alone,
    a token a pass) to the planned gamma1, for the observed rate of those drafts: where a wider pass
    costs (a CPU's: 36 ms for 5 tokens against 16 for one, 2K held-out prose, Zen 3) and prompt
    lookup's drafts are mostly refused (15% kept there), checking them cost more than they gave."""

    def __init__(self, costs: StepCosts, hw: Hardware, most: int):
        # each check's price, by its tier-0 drafts: asked before every retrieval check, priced once
        self.check_ms = [tier1_ms(costs, hw, g1 + 1) + g1 * tier0_ms(costs, hw) for g1 in range(most + 1)]

    def choose(self, alpha: float) -> int:
        alpha = min(max(alpha, 0.0), 1.0)
        per_token = [ms / expected_tokens(alpha, g1) for g1, ms in enumerate(self.check_ms)]
        fastest = min(per_token)
        return max(g1 for g1, ms in enumerate(per_token) if ms <= fastest * (1 + TIE_FRACTION))


@dataclass(frozen=True)
class RoundPrices:
    """The cost model's price of the forward passes a decoding round ran, at the length it ran at:
    --method auto's online check compares speculation's priced rounds with an ar step."""
    costs: StepCosts
    hw: Hardware
    resident_tokens: int

    def pass_ms(self, kind: str, tokens: int, length: int) -> float:
        """kind: full (the full cache, `tokens` fed), sparse (tier 1), draft (a tier-0 model's
        step) or lookup (free)."""
        if kind == "full":
            return full_verify_ms(costs_at(self.costs, self.resident_tokens, length), self.hw, tokens)
        if kind == "sparse":
            return tier1_ms(self.costs, self.hw, tokens)
        if kind == "draft":
            return tokens * tier0_ms(self.costs, self.hw)
        return 0.0

    def ar_ms(self, length: int) -> float:
        return self.pass_ms("full", 1, length)
