"""The GPU campaign's steps, in the order of a user's journey. The default call is the 2026
desktop's (desktop.py, issue 72): a Llama-3.1-8B Q4_K_M file whose 128K KV fits the card, ours
beside llama.cpp's CUDA build on it; a Qwen3-32B file whose KV lives on the host, beside llama.cpp
attending on the CPU; DeepSpeed ZeRO-Inference beside our offloaded rows; the paper's Llama2-7B at
32K, short. A second call (--only NAMES, or --all) runs the rest: the paper's 32K and 127K prefills
and decoding, a new user's commands, tests/gpu, the block kernels, peers, tier steps, the best
case, and the desktop's other contexts and KV types.

Each step says what work it does (`Work`: a prefill, a decode over methods, tests, or a fixed
job), and its command is built from that work, so the estimate and the command cannot disagree.
`Scale` picks the shapes: the campaign's (Llama2-7B-128K, 32K and 127K, a 24 GB budget) or a
reduced one that runs every step on a CPU in seconds.

A step's estimate is what it should cost on the lent card before it runs (predicted, not
measured): `--dry-run` prints it, the campaign skips a step whose estimate exceeds the time left
rather than lose it to a cut, each step's time limit follows from it, and a test holds the
default call under LEASE_S.

An estimate is one-time costs (a process's start, random weights, graph captures, Triton
compiles: constants below, each labelled measured or assumed) plus the work the cost model
predicts on the profile's rates with the capped card's plan (plan.planner, plan.cost_model):
decoding as tokens x predicted ms/token, a prefill as its FLOPs at a share of the tensor-core rate
plus its host KV over the link, a host KV store as its bytes over the rate a store was allocated,
pinned and filled at on the last H100."""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from triforce.bench.campaign.desktop import DESKTOP, REDUCED_DESKTOP, Desktop, desktop_steps
from triforce.bench.campaign.work import BEST_CASE_TRACE, HOME, TRACE, Decode, Fixed, Prefill, Step, Tests

# decoding after a prefill: triforce with each part on and off, beside both AR baselines
DECODE_METHODS = ("ar-offload", "ar-hybrid", "triforce", "triforce-ahead", "triforce-no-hybrid",
                  "triforce-no-residency")
PEER_METHODS = ("ar-offload", "triforce", "zero-inference", "transformers-offloaded")  # ratios within one run
# at 127K in the default call: the hybrid verify on and off (it lost at 32K on 2026-11-28 and won for ar at 127K)
DECODE_METHODS_127K = ("ar-offload", "ar-hybrid", "triforce", "triforce-no-hybrid")
# BLOCK_N:STEP:WARPS:STAGES:SPLIT of the block kernels to try (quant_launch: one row takes the gemv
# kernel, 16 the dot one): the split planned by the shape with other tiles, then the first kernels'
# tiles without a split (128 programs: the H200's 5.4-12.1x), then splits set by hand
TILE_SWEEP = "16:8:4:3:auto,32:8:4:3:auto,16:16:4:3:auto,16:4:8:4:auto,32:8:4:3:1,16:8:4:3:8,64:8:8:3:4"


@dataclass(frozen=True)
class Scale:
    arch: str
    contexts: tuple[int, int]            # "32k" and "127k"
    dtype: str
    budget_flags: tuple[str, ...]        # the 24 GB card, or a reduced run's device budget
    speculation: tuple[str, ...] = ()    # flags a small model needs (a retrieval budget below its context)
    kernels_arch: str = "llama3.1-8b"    # the 24 GB desktop's model (a Q4_K_M file: q4_k and q6_k)
    draft: str = "llama-68m"
    reduced: bool = False
    desktop: Desktop | None = None


CAMPAIGN = Scale("llama2-7b-128k", (32768, 130048), "bfloat16", ("--profile", "rtx4090-24g"), desktop=DESKTOP)
# every step on a CPU: a 2-layer model offloads part of its KV under a 4.5 MB "card" (float32)
REDUCED = Scale("tiny-test", (1000, 1100), "float32", ("--device-budget", "4.5MB"), ("--budget", "256"),
                kernels_arch="llama-68m", draft="lookup", reduced=True, desktop=REDUCED_DESKTOP)


def decode_argv(scale: Scale, d: Decode, plot: str) -> tuple[str, ...]:
    argv = ["-m", "triforce.cli.main", "bench", "offload", "--arch", scale.arch, *scale.budget_flags,
            "--context", str(d.context), "--methods", ",".join(d.methods), "--acceptance-trace", d.trace,
            "--new-tokens", str(d.new_tokens), "--repeats", str(d.repeats), "--speculative-tokens",
            str(d.speculative_tokens), "--dtype", scale.dtype, *scale.speculation, "--plot", plot, "--json"]
    if scale.reduced:
        argv += ["--draft", scale.draft]
    if d.quantize:
        argv += ["--quantize", d.quantize]
    return tuple(argv)


def prefill_argv(scale: Scale, p: Prefill) -> tuple[str, ...]:
    return ("-m", "triforce.bench.prefill_ttft", "--arch", scale.arch, "--context", str(p.context),
            "--new-tokens", str(p.new_tokens), "--acceptance-trace", TRACE, *scale.budget_flags, "--dtype", scale.dtype,
            *(("--breakdown",) if p.breakdown else ()), "--json")


def steps(out_dir, scale: Scale = CAMPAIGN) -> list[Step]:
    short, long = scale.contexts
    quant = "q8_0" if scale.reduced else "q4_k"  # tiny-test's rows (64) are too short for q4_k's 256
    tier_contexts = "512" if scale.reduced else "4096,8192"
    gpu_tests = Tests(("tests/gpu",), 3.94)  # 39 tests in 161.7 s on the H200, 2026-11-28 (second run)
    quant_tests = Tests(("tests/unit/test_quant_triton.py",), 1.57)  # 28 in 44 s on the first

    def decode(name, what, d: Decode, default=True):
        return Step(name, what, d, decode_argv(scale, d, str(out_dir / f"{name}.png")), default, streams_rows=True)

    def prefill(name, context, breakdown=False, default=True):
        p = Prefill(context, breakdown=breakdown)
        return Step(name, f"a {name.split('-')[1].upper()} prompt prefilled through the offloaded path on a 24 GB "
                          "budget: time to first token, bytes moved, peak GPU memory against the plan",
                    p, prefill_argv(scale, p), default)

    kernels = ("-m", "triforce.bench.quant_kernels", "--arch", scale.kernels_arch, "--rows", "1,16",
               "--formats", "q4_k,q6_k,q8_0", "--dtype", scale.dtype,
               "--repeats", "3" if scale.reduced else "30", "--json")
    tier_steps = ("-m", "triforce.bench.tier_steps", "--arch", scale.arch, "--draft",
                  "" if scale.reduced else scale.draft, "--contexts", tier_contexts, "--dtype", scale.dtype,
                  "--repeats", "2" if scale.reduced else "10", "--json")
    desk = desktop_steps(scale, out_dir)
    journey = [s for s in desk if s.default]  # the 2026 desktop first (issue 72)
    return [
        Step("probe", "device, versions, exact pinning, copy bandwidths",
             Fixed(9.5, "measured: H200 campaign 2026-11-28"), ("-m", "triforce.bench.campaign.gpu_probe")),
        # what users do first: a long prompt prefilled, then decoded; then a new user's commands and tests
        *journey,
        # the paper's setting, kept short: Llama2-7B-128K at 32K, plain offloaded decoding beside triforce
        decode("paper-32k", "the paper's model at 32K: ar-offload and triforce (natural-text trace)",
               Decode(short, ("ar-offload", "triforce"), new_tokens=8, speculative_tokens=32)),
        # what the default call leaves for a second one (--only NAMES, or --all)
        prefill("prefill-32k", short, breakdown=True, default=False),  # 6.2 s against ~1.5 s of FLOPs and copies
        prefill("prefill-127k", long, default=False),
        decode("decode-127k", "decoding at 127K: triforce with the hybrid verify on and off, beside ar-offload and "
                              "ar-hybrid (natural-text trace; few tokens a row: each ar token moves ~60 GB)",
               Decode(long, DECODE_METHODS_127K, new_tokens=8, speculative_tokens=32), default=False),
        Step("user", "a new user's commands with default flags on a random model made here",
             Fixed(113, "measured: H200 2026-11-28, 143 s less the 30 s serve hung"),
             ("-m", "triforce.bench.campaign.user_step", "--json"), default=False),
        Step("gpu-tests", "tests/gpu: graphs == eager, no graph fallback, float32 logits, Triton retrieval, sync "
                          "counts, offload with copy streams, sampling, SDPA kernels, the prefill's kernel path, "
                          "the profiler's kernel kinds",
             gpu_tests, ("-m", "pytest", "-q", "-p", "no:cacheprovider", *gpu_tests.paths), default=False),
        decode("decode-32k", "decoding at 32K: triforce with hybrid, residency and drafting ahead on and off, "
                             "ar-offload and ar-hybrid beside it (natural-text trace)",
               Decode(short, DECODE_METHODS, new_tokens=8, speculative_tokens=32), default=False),
        Step("quant-kernels", "the Triton block kernels against bf16 F.linear and the bytes floor, 1 and 16 rows",
             Fixed(25, "assumed: 15 s for two formats on the H200 2026-11-28, now three"), kernels, default=False),
        Step("quant-tiles", "the Triton block kernels' tiles and column splits swept (the shipped ones untuned)",
             Fixed(110, "assumed: quant-kernels' 25 s, seven tiles of three formats compiled and timed"),
             kernels if scale.reduced else (*kernels[:-1], "--tiles", TILE_SWEEP, "--write-table",
                                            str(out_dir / "tile_table.json"), "--json"), default=False),
        Step("quant-tests", "Triton block kernels against the reference on the card",
             quant_tests, ("-m", "pytest", "-q", "-p", "no:cacheprovider", *quant_tests.paths), default=False),
        decode("decode-127k-q4k", f"decoding at 127K with {quant} projections: more of the KV resident",
               Decode(long, ("ar-offload", "ar-hybrid", "triforce"), new_tokens=8, speculative_tokens=32,
                      quantize=quant), default=False),
        Step("tier-steps-q4k", f"tier step times with {quant} projections against their bytes floor",
             Fixed(22.2, "measured: H200 campaign 2026-11-28"), (*tier_steps[:-1], "--attn", "sdpa",
                                                                           "--quantize", quant, "--json"),
             default=False),
        decode("peers-32k", "peers at 32K beside ours in one run: ZeRO-Inference-style CPU attention, "
                            "transformers' offloaded cache", Decode(short, PEER_METHODS), default=False),
        Step("tier-steps", "tier step times against their bytes floor, graphs on/off, SDPA and flash-attn",
             Fixed(17.8, "measured: H200 campaign 2026-11-28"), (*tier_steps[:-1], "--attn", "sdpa,flash", "--json"),
             default=False),
        tp_on_one_card(scale, out_dir),
        decode("decode-127k-best-case", "triforce at 127K replaying the repeated-filler needle trace (a best case)",
               Decode(long, ("triforce",), trace=BEST_CASE_TRACE, new_tokens=8, speculative_tokens=32),
               default=False),
        *(s for s in desk if not s.default),
    ]


def tp_on_one_card(scale: Scale, out_dir) -> Step:
    """`--tp 2` as two gloo ranks on the lease's one card (NCCL refuses two ranks on one device):
    the tensor-parallel path's CUDA side meets hardware (placement, streams, graphs around the
    collectives); NCCL itself and the speed of two cards stay unmeasured."""
    d = Decode(scale.contexts[0] if scale.reduced else 8192, ("ar-offload", "triforce"), new_tokens=8,
               speculative_tokens=16)
    return Step("tp2-one-card", "--tp 2 as two gloo ranks on the one card: the tensor-parallel path's CUDA side "
                                "(NCCL itself unmeasured)",
                Fixed(60, "assumed: two processes with half of the random 7B each, an 8K context"),
                (*decode_argv(scale, d, str(out_dir / "tp2-one-card.png")), "--tp", "2"), default=False,
                env=(("TRIFORCE_TP_ONE_CARD", "1"),))


# the default call's wall time: a lease's 15 minutes less the machine's start (32 s on 2026-11-28;
# "a minute or more" by the device README) and a second call for what it left; its steps are
# estimated within JOURNEY_S, the rest of the budget absorbing estimates that run over
LEASE_S = 540
JOURNEY_S = 480
PROCESS_S = 8.0        # a step's process: Python, torch and the CUDA context (assumed)
WEIGHTS_S = 6.0        # random 7B weights built on the card (assumed)
METHOD_S = 3.0         # per decode row: plan, cache, warm-up, graph captures (assumed)
HOST_STORE_GBPS = 3.0  # host KV allocated, pinned and filled (measured: the offload steps of 2026-11-23 less decoding)
PREFILL_EFFICIENCY = 0.4  # share of the nominal tensor-core rate a long flash prefill reaches (assumed)
PROFILER_S = 3.0  # the CUDA profiler's overhead and its tally of ~20K kernels (assumed)
FIRST_TOKEN_S = 3.2  # the first token after an offloaded prefill (measured: H200 2026-11-28, 3.19 s at 32K)
# a triforce row's first 32 tokens over its steady state (measured: 2.0-3.6x, the same run): the
# trace's first full verifies reject (4 verifies in window 1, 2 in window 2), and the hybrid split's first passes
FIRST_WINDOW_FACTOR = 3.0
# triforce measured over predicted without the hybrid split (2026-11-23: 37.6 and 232 ms/token against 29
# and 172); the hybrid split has never run on a card, so its predicted gain is not counted here
SPECULATIVE_FACTOR = 1.35
PEER_FACTOR = {"zero-inference": 2.2, "transformers-offloaded": 1.5}  # of ar-offload (2026-11-23: 653/182, 2753/1141; assumed)
LIMIT_FACTOR, LIMIT_FLOOR_S = 2.0, 60  # a step's own limit: twice its estimate, at least a minute
# decode steps measured over estimated (H200, 2026-11-28): decode-32k 60.5 s against 52, decode-127k's
# first four rows ~140 s against 115 (peers-32k ran under its estimate: 58.9 against 71)
DECODE_FACTOR = 1.25


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

    return predict(profile, f"{cap_gb:g}GB", context, load_trace(str(HOME / trace_path)))


@lru_cache(maxsize=None)
def _test_count(paths: tuple[str, ...]) -> int:
    """Tests pytest collects under `paths` (they collect on any machine; on a CPU they skip)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *paths],
                          capture_output=True, text=True, timeout=120, cwd=HOME)
    return sum(1 for line in done.stdout.splitlines() if "::" in line)


def estimate(step: Step, profile: str = "h100-80g", cap_gb: float = 24.0) -> Estimate:
    work = step.work
    if isinstance(work, Fixed):
        return Estimate(work.seconds, {"job": work.seconds}, work.source)
    if isinstance(work, Tests):
        n = _test_count(work.paths)
        return Estimate(PROCESS_S + n * work.seconds_per_test, {"start": PROCESS_S, f"{n} tests": n * work.seconds_per_test},
                        "measured per-test time of 2026-11-28 x the tests collected now")
    if isinstance(work, Prefill):
        return _prefill(work, profile, cap_gb)
    if isinstance(work, Decode):
        return _decode(work, profile, cap_gb)
    raise TypeError(f"no estimate for {type(work).__name__}")


def _prefill(p: Prefill, profile: str, cap_gb: float) -> Estimate:
    from triforce.plan.profiles import load_profile

    pred = _prediction(profile, cap_gb, p.context, TRACE)
    hw = load_profile(profile)
    c = pred["costs"]
    flops = p.context * c.flops_per_token + c.attention_flops_per_key * p.context ** 2 / 2
    compute = flops / (hw.compute_tflops * 1e12 * PREFILL_EFFICIENCY)
    host = pred["host_kv_bytes"]
    groups = math.ceil(p.context / pred["prefill_group"])
    links = (groups * host / 2) / (hw.pcie_h2d_gbps * 1e9) + host / (hw.pcie_d2h_gbps * 1e9)  # read back, written out
    decode = p.new_tokens * pred["by_method"]["triforce-no-hybrid"] * SPECULATIVE_FACTOR * FIRST_WINDOW_FACTOR / 1000
    parts = {"start": PROCESS_S, "weights": WEIGHTS_S, "host store": host / (HOST_STORE_GBPS * 1e9),
             "prefill compute": compute, "prefill copies": links, "first token": FIRST_TOKEN_S, "decode": decode}
    if p.breakdown:
        parts["profiler"] = PROFILER_S
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
    parts = {k: v * DECODE_FACTOR for k, v in parts.items()}
    return Estimate(sum(parts.values()), parts, f"cost model, {profile} capped to {cap_gb:g} GB, triforce "
                    f"x{SPECULATIVE_FACTOR}, the step x{DECODE_FACTOR} as measured")


def plan_total(chosen: list[Step], profile: str = "h100-80g", cap_gb: float = 24.0) -> float:
    return sum(estimate(s, profile, cap_gb).seconds for s in chosen)
