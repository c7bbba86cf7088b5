"""What a campaign step does (`Fixed` work, `Tests`, a `Prefill`, a `Decode` over methods) and the
step itself: its estimate is priced from its work and its command built from it (steps.py)."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

# the checkout's root, or the installed package's folder: bench/traces/ lies under both (package
# data), so the campaign reads its traces from any working directory and its commands name them
# relative to here (gpu_campaign runs them from here)
HOME = Path(__file__).resolve().parents[2]

# acceptance traces replayed by random-weight architectures: recorded on natural text (what users
# bring) at the paper's budget 4096 and gamma2 up to 15; the best case, a needle in one repeated
# filler sentence that the model recites, last. The 32K YaRN trace shows the 135M model reciting
# itself (0.97 kept) and is not the headline.
TRACE = "bench/traces/smollm2-natural8k-b4096-g15-triforce-lookup.json"
BEST_CASE_TRACE = "bench/traces/smollm2-needle8k-repeated-filler-triforce-lookup.json"


@dataclass(frozen=True)
class Fixed:
    """Work the cost model does not see: its seconds, and where that number comes from."""
    seconds: float
    source: str


@dataclass(frozen=True)
class Tests:
    paths: tuple[str, ...]
    seconds_per_test: float  # measured on the last GPU (see where each Tests is made)


@dataclass(frozen=True)
class Prefill:
    context: int
    new_tokens: int = 32  # timed one by one after the first, replaying TRACE: where an answer's start goes
    breakdown: bool = False  # under the CUDA profiler: kernels by kind, copies, time no kernel ran


@dataclass(frozen=True)
class Decode:
    context: int
    methods: tuple[str, ...]
    trace: str = TRACE
    new_tokens: int = 16
    repeats: int = 2
    speculative_tokens: int = 64
    quantize: str | None = None


@dataclass(frozen=True)
class Step:
    name: str
    what: str
    work: object                       # Fixed | Tests | Prefill | Decode
    argv: tuple[str, ...]              # after `python -m triforce.bench.campaign.capped --gb CAP --`
    default: bool = True               # in the default call (which fits a lease); else named by --only or --all
    streams_rows: bool = field(default=False)  # `bench offload`: its rows go to OUT/NAME.rows.jsonl as timed
    env: tuple[tuple[str, str], ...] = ()       # set for its process
