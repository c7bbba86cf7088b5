"""Small frozen configuration objects of a run (sampling, speculation, the run), validated when built;
the model's shape is triforce.config.model's."""
from __future__ import annotations

from dataclasses import dataclass, field

from triforce.errors import UserError

SEED_MIN, SEED_MAX = -2**63, 2**64 - 1  # what torch.Generator.manual_seed takes: signed or unsigned 64 bits


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy (argmax); top_k 0 and top_p 1 disable those filters. The
    penalties act on the logits of tokens among the context's last penalty_last_n (prompt
    included), before temperature, as llama.cpp applies them: repeat_penalty divides a positive
    logit and multiplies a negative one; presence_penalty is subtracted once, frequency_penalty
    once per occurrence (OpenAI's). They change the distribution itself, so every tier applies them.
    seed: a 64-bit integer; a seeded sample's text depends on the seed, the model and the context
    alone (decoding.sampling.PositionNoise), not on the method, the cache or the batch."""
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    repeat_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    penalty_last_n: int = 64

    def __post_init__(self):
        if not self.temperature >= 0:
            raise UserError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise UserError(f"top-p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise UserError(f"top-k must be >= 0, got {self.top_k}")
        if not 0 < self.repeat_penalty <= 10:
            raise UserError(f"repeat penalty must be in (0, 10], got {self.repeat_penalty}")
        for name in ("presence", "frequency"):
            value = getattr(self, f"{name}_penalty")
            if not -2 <= value <= 2:
                raise UserError(f"{name} penalty must be in [-2, 2], got {value}")
        if not isinstance(self.penalty_last_n, int) or self.penalty_last_n < 1:
            raise UserError(f"penalty last n must be an integer >= 1, got {self.penalty_last_n}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not SEED_MIN <= self.seed <= SEED_MAX):
            raise UserError(f"seed must be an integer from {SEED_MIN} to {SEED_MAX} (64 bits), got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        return self.repeat_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0


# chat's defaults. A small model answers best near greedy: at 0.7 the default model answered the
# README's own question wrongly and once ran to the 512-token cap; greedy alone falls into loops
# more often. Without a repeat penalty 2 of 20 answers still ran to the cap; with 1.1 none of 20
# did (`triforce eval loops`, bench/RESULTS.md)
CHAT_SAMPLING = SamplingParams(temperature=0.2, top_p=0.9, repeat_penalty=1.1)


PREFILL_CHUNKS = (1024, 512, 256, 128, 64)  # tokens per prefill forward: the planner takes the largest that fits
# queries per attention call of a layer-major (offloaded) prefill: each call streams the layer's
# host KV once, so a 32K prompt reads it 4 times per layer instead of 32 (at 1024-token chunks)
PREFILL_GROUP = 8192
METHODS = ("ar", "triforce", "retrieval", "streaming", "snapkv", "naive")
SNAPKV_WINDOW = 32  # SnapKV's observation window (tokens), as the MagicDec paper uses it
MAX_GRAPH_TOKENS = 16  # CUDA graphs are kept for steps of 1..16 new tokens; longer steps run eagerly
AUTO = "auto"  # the cost model picks one of the methods (triforce.plan.method_choice)


@dataclass(frozen=True)
class SpecParams:
    """How to speculate.

    method: ar | triforce (draft -> retrieval -> full) | retrieval (retrieval -> full) |
    streaming (target with a StreamingLLM cache -> full) | snapkv (target with a SnapKV cache -> full)
    | naive (draft -> full) | auto (one of
    them, chosen when the run is planned; nothing decodes with auto itself).
    gamma2: tokens proposed to each full verify (the engine may adapt it within [gamma2_min,
    gamma2_max], both gamma2 unless set); gamma1: drafts per retrieval-tier check (triforce only).
    budget: tokens in the retrieval/streaming cache. The retrieval cache is rebuilt every
    rebuild_stride tokens, or sooner when the full tier's rolling acceptance of its proposals
    falls below rebuild_threshold."""
    method: str = "ar"
    gamma1: int = 4
    gamma2: int = 8
    budget: int = 1024
    chunk_size: int = 8
    rebuild_stride: int = 256
    rebuild_threshold: float = 0.3  # bench/history/2026-11-23-cpu-default-model.md
    sink_tokens: int = 16
    draft_window: int = 256
    gamma2_min: int | None = None
    gamma2_max: int | None = None
    snapkv_window: int = SNAPKV_WINDOW

    def __post_init__(self):
        if self.method not in METHODS + (AUTO,):
            raise UserError(f"unknown method '{self.method}' (choose from {', '.join(METHODS + (AUTO,))})")
        for name in ("gamma1", "gamma2", "chunk_size", "rebuild_stride", "draft_window", "snapkv_window"):
            if getattr(self, name) < 1:
                raise UserError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.sink_tokens < 0:
            raise UserError(f"sink tokens must be >= 0, got {self.sink_tokens}")
        if self.budget < 2 * self.chunk_size:
            raise UserError(f"--budget ({self.budget}) must hold at least two chunks "
                            f"(2 x --chunk-size = {2 * self.chunk_size})")
        if self.budget <= self.sink_tokens:
            raise UserError(f"--budget ({self.budget}) must exceed the {self.sink_tokens} sink tokens")
        if self.method == "snapkv" and self.budget <= self.snapkv_window:
            raise UserError(f"--budget ({self.budget}) must exceed SnapKV's {self.snapkv_window}-token "
                            "observation window")
        if not 0 <= self.rebuild_threshold <= 1:
            raise UserError(f"rebuild threshold must be in [0, 1], got {self.rebuild_threshold}")
        if not 1 <= self.gamma2_range[0] <= self.gamma2 <= self.gamma2_range[1]:
            raise UserError(f"gamma2 bounds {self.gamma2_range} must hold gamma2 = {self.gamma2}")

    @property
    def gamma2_range(self) -> tuple[int, int]:
        """The values gamma2 may take while generating (adaptive when they differ)."""
        return (self.gamma2 if self.gamma2_min is None else self.gamma2_min,
                self.gamma2 if self.gamma2_max is None else self.gamma2_max)

    @property
    def uses_draft(self) -> bool:
        return self.method in ("triforce", "naive", AUTO)  # auto may pick a drafting method

    @property
    def longest_graph_step(self) -> int:
        """The longest drafting-tier step kept as a CUDA graph: the runners capture 1..this tokens
        (decoding.tiers) and the planner reserves their logits (plan.planner)."""
        return min(MAX_GRAPH_TOKENS, max(self.gamma1, self.gamma2) + 1)

    @property
    def uses_sparse_cache(self) -> bool:
        return self.method in ("triforce", "retrieval", "streaming", "snapkv")

    @property
    def sparse_policy(self) -> str:
        """The selection policy of the sparse tier (where there is one)."""
        return self.method if self.method in ("streaming", "snapkv") else "retrieval"

    @property
    def selection_window(self) -> int:
        """Tokens whose queries a selection reads: SnapKV's observation window, else the last token."""
        return self.snapkv_window if self.method == "snapkv" else 1

    @property
    def sparse_append_slots(self) -> int:
        """Tokens a sparse cache may take after a selection before it must be rebuilt: the
        stride and two rounds of drafting ahead (triforce.decoding.draft_ahead) past it."""
        return self.rebuild_stride + 4 * (self.gamma1 + self.gamma2_range[1] + 2)

    @property
    def draft_slack(self) -> int:
        """The longest rollback of the draft model's streaming cache: a cycle's drafts and
        the next cycle's drafted ahead of their verify (triforce.decoding.draft_ahead)."""
        return 2 * (self.gamma1 + self.gamma2_range[1] + 2)

    @property
    def draft_window_tokens(self) -> int:
        return max(self.draft_window, self.draft_slack)


def build_spec(method, budget=None, chunk_size=None, gamma1=None, gamma2=None, rebuild_stride=None,
               rebuild_threshold=None):
    """(SpecParams, the names of the tunable values given) from the CLI's flags or triforce.LLM's
    keywords: those left None take the dataclass defaults here; the cost model may replace the
    tunable ones later (triforce.app.plan_and_cache)."""
    given = {"budget": budget, "chunk_size": chunk_size, "gamma1": gamma1, "gamma2": gamma2}
    fixed = frozenset(name for name, value in given.items() if value is not None)
    rebuild = {k: v for k, v in (("rebuild_stride", rebuild_stride), ("rebuild_threshold", rebuild_threshold))
               if v is not None}
    return SpecParams(method=method, **rebuild, **{name: given[name] for name in fixed}), fixed


@dataclass(frozen=True)
class RunConfig:
    """Everything a runtime needs; picklable, so tensor-parallel ranks can receive it."""
    model: str | None = "default"  # Hugging Face folder, .gguf file or 'default'
    arch: str | None = None        # instead of model: a named architecture with random weights (timing)
    draft: str | None = None       # model path, architecture name, 'lookup', 'none' (None: lookup)
    spec: SpecParams = field(default_factory=SpecParams)
    fixed: frozenset = frozenset()  # speculation flags the user gave (the cost model fills the rest)
    dtype: str = "auto"
    quantize: str = "auto"          # projections as GGUF blocks (triforce.model.quantized): auto | gguf | q8_0 | q4_0 | q4_1 | q4_k | none
    device: str = "auto"
    profile: str | None = None
    device_budget: str | None = None
    attn: str = "auto"              # auto | flash | sdpa | sdpa-reference
    graphs: str = "auto"            # auto | off | static (see Engine)
    overlap: bool = True            # prefetch offloaded KV while drafting
    hybrid: bool = True             # the CPU attends a share of short passes' host KV in place (offload.hybrid)
    draft_ahead: bool = False       # draft the next cycle during each full verify (decoding.draft_ahead)
    count_syncs: bool = False       # host synchronisations per decoding phase (CUDA)
    max_context: int | None = None  # tokens the context holds (None: the model's own)
    rope_scaling: str | None = None  # stretch the RoPE to max_context (yarn | linear | dynamic)
    threads: int | None = None       # CPU threads of the kernels (None: the cores available; see app.threads)
    parse_special_tokens: bool = False  # read control tokens written inside chat messages (role injection)
