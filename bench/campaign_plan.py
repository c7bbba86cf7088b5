"""What each GPU campaign step should cost on the lent card, before it runs (predicted, not
measured): `--dry-run` prints it, the campaign skips a step whose estimate exceeds the time left
rather than lose it to a cut, each step's time limit follows from it, and a test holds the
default call under LEASE_S.

An estimate is one-time costs (a process's start, random weights, graph captures, Triton
compiles: constants below, each labelled measured or assumed) plus the work the cost model
predicts on the profile's rates with the capped card's plan (offload.planner, offload.cost_model):
decoding as tokens x predicted ms/token, a prefill as its FLOPs at a share of the tensor-core rate
plus its host KV over the link, a host KV store as its bytes over the rate a store was allocated,
pinned and filled at on the last H100."""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from triforce.bench.campaign_steps import Decode, Fixed, Prefill, Step, Tests

LEASE_S = 480          # the default call's wall time: a lease's 15 minutes less the machine's start and a rerun
PROCESS_S = 8.0        # a step's process: Python, torch and the CUDA context (assumed)
WEIGHTS_S = 6.0        # random 7B weights built on the card (assumed)
METHOD_S = 3.0         # per decode row: plan, cache, warm-up, graph captures (assumed)
TEST_S = 1.8           # per GPU test (measured: 22 tests in 39.7 s, H100 campaign 2026-11-23)
HOST_STORE_GBPS = 3.0  # host KV allocated, pinned and filled (measured: the offload steps of 2026-11-23 less decoding)
PREFILL_EFFICIENCY = 0.4  # share of the nominal tensor-core rate a long flash prefill reaches (assumed)
# triforce measured over predicted without the hybrid split (2026-11-23: 37.6 and 232 ms/token against 29
# and 172); the hybrid split has never run on a card, so its predicted gain is not counted here
SPECULATIVE_FACTOR = 1.35
PEER_FACTOR = {"zero-inference": 2.2, "transformers-offloaded": 1.5}  # of ar-offload (2026-11-23: 653/182, 2753/1141; assumed)
LIMIT_FACTOR, LIMIT_FLOOR_S = 2.0, 60  # a step's own limit: twice its estimate, at least a minute


@dataclass(frozen=True)
class Estimate:
    seconds: float
    parts: dict           # name -> seconds
    source: str           # where the figures come from

    @property
    def limit_s(self) -> int:
        return int(max(LIMIT_FLOOR_S, LIMIT_FACTOR * self.seconds))


@lru_cache(maxsize=None)
def _prediction(profile: str, cap_gb: float, context: int, trace_path: str) -> dict:
    from triforce.bench.offload_predictions import predict
    from triforce.decoding.acceptance_trace import load_trace

    return predict(profile, f"{cap_gb:g}GB", context, load_trace(trace_path))


@lru_cache(maxsize=None)
def _test_count(paths: tuple[str, ...]) -> int:
    """Tests pytest collects under `paths` (they collect on any machine; on a CPU they skip)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *paths],
                          capture_output=True, text=True, timeout=120)
    return sum(1 for line in done.stdout.splitlines() if "::" in line)


def estimate(step: Step, profile: str = "h100-80g", cap_gb: float = 24.0) -> Estimate:
    work = step.work
    if isinstance(work, Fixed):
        return Estimate(work.seconds, {"job": work.seconds}, work.source)
    if isinstance(work, Tests):
        n = _test_count(work.paths)
        return Estimate(PROCESS_S + n * TEST_S, {"start": PROCESS_S, f"{n} tests": n * TEST_S},
                        "measured per-test time of 2026-11-23 x the tests collected now")
    if isinstance(work, Prefill):
        return _prefill(work, profile, cap_gb)
    if isinstance(work, Decode):
        return _decode(work, profile, cap_gb)
    raise TypeError(f"no estimate for {type(work).__name__}")


def _prefill(p: Prefill, profile: str, cap_gb: float) -> Estimate:
    from triforce.bench.campaign_steps import TRACE
    from triforce.offload.profiles import load_profile

    pred = _prediction(profile, cap_gb, p.context, TRACE)
    hw = load_profile(profile)
    c = pred["costs"]
    flops = p.context * c.flops_per_token + c.attention_flops_per_key * p.context ** 2 / 2
    compute = flops / (hw.compute_tflops * 1e12 * PREFILL_EFFICIENCY)
    host = pred["host_kv_bytes"]
    groups = math.ceil(p.context / pred["prefill_group"])
    links = (groups * host / 2) / (hw.pcie_h2d_gbps * 1e9) + host / (hw.pcie_d2h_gbps * 1e9)  # read back, written out
    decode = (p.new_tokens + 1) * pred["by_method"]["triforce-no-hybrid"] * SPECULATIVE_FACTOR / 1000
    parts = {"start": PROCESS_S, "weights": WEIGHTS_S, "host store": host / (HOST_STORE_GBPS * 1e9),
             "prefill compute": compute, "prefill copies": links, "decode": decode}
    return Estimate(sum(parts.values()), parts, f"cost model, {profile} capped to {cap_gb:g} GB")


def _decode(d: Decode, profile: str, cap_gb: float) -> Estimate:
    pred = _prediction(profile, cap_gb, d.context, d.trace)
    by = pred["by_method"]
    parts = {"start": PROCESS_S, "weights": WEIGHTS_S, "host store (once)": pred["host_kv_bytes"] / (HOST_STORE_GBPS * 1e9)}
    for method in d.methods:
        if method.startswith("triforce"):
            ms = by["triforce-no-hybrid"] * SPECULATIVE_FACTOR * (0.9 if method == "triforce-ahead" else 1.0)
            tokens = 2 + max(d.new_tokens, d.speculative_tokens) * d.repeats + pred["gamma2"] + 1
        else:
            ms = by["ar-offload"] * PEER_FACTOR.get(method, 1.0)
            tokens = 2 + d.new_tokens * d.repeats + 1
        parts[method] = METHOD_S + tokens * ms / 1000
    return Estimate(sum(parts.values()), parts,
                    f"cost model, {profile} capped to {cap_gb:g} GB, triforce x{SPECULATIVE_FACTOR} as measured")


def plan_total(chosen: list[Step], profile: str = "h100-80g", cap_gb: float = 24.0) -> float:
    return sum(estimate(s, profile, cap_gb).seconds for s in chosen)
