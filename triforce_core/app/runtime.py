"""One runtime builder for every entry point (generate, chat, bench, and later the server):
load the target and the draft, choose attention, then plan, build the full cache and the engine
with its hooks. The CLI only parses flags into a RunConfig."""
from __future__ import annotations

import os
import sys
import time
from contextlib import nullcontext
from dataclasses import replace
from functools import partial

import torch

from triforce.app.start_steps import active, start_step
from triforce.app.plan_and_cache import RunPlan, build_kv_cache, plan_run, refuse_before_loading, resolve_profile
from triforce.config import RunConfig, SpecParams
from triforce.decoding.draft import Draft, resolve_draft
from triforce.decoding.engine import Engine
from triforce.decoding.hooks import EngineHooks
from triforce.errors import UserError
from triforce.model.context_stretch import run_context, stretch_request
from triforce.paths import shown

ROOM_STEP = 1024  # tokens: a kept engine's context grows in these steps (Runtime.kept_engine)
SHORTEST_RUN = 16  # tokens: a plan that cannot hold even these fails for the weights and buffers alone


class Runtime:
    """The loaded models of one rank and the engines built over them."""

    def __init__(self, config: RunConfig, rank: int = 0, world: int = 1):
        from triforce.app.parallel import rank_device, share_threads
        from triforce.kernels import select_attention

        self.config, self.rank, self.world = config, rank, world
        device = config.device
        if world > 1:
            device = rank_device(config.device, rank)
            share_threads(world, config.threads)
        else:
            from triforce.app.threads import use_threads
            use_threads(config.threads)
        started = time.perf_counter()
        shard = (rank, world) if world > 1 else None
        stretch = stretch_request(config.max_context, config.rope_scaling)
        weights = weights_as(config, device, world)
        if world == 1:
            from triforce.model.loading import resolve_device
            refuse_before_loading(config, resolve_device(device), weights)
        what = config.arch or ("the default model" if config.model == "default" else shown(config.model))
        with start_step(f"loading {what}", rank):
            self.lm = _load(config.arch, config.model, config.dtype, device, shard, stretch, weights,
                            required=config.quantize != "auto")
        self.context = run_context(self.lm.config.max_position_embeddings, config.max_context)
        with start_step(f"loading the draft {config.draft}", rank) if config.draft not in (None, "lookup") \
                else nullcontext():
            self.draft: Draft = resolve_draft(config.draft, config.spec,
                                              load=lambda name: load_draft(name, config.dtype, device))
        try:
            backend, self.attn_line = select_attention(config.attn, self.lm.device)
        except ValueError as e:
            raise UserError(str(e)) from None
        self.lm.attn = backend
        if self.draft.model is not None:
            self.draft.model.attn = backend
        self.attn_name = backend.name
        # once: an automatic profile reads the device, and counts what is loaded the same either way
        self.profile = resolve_profile(config.profile, self.lm.device, config.device_budget)
        if self.profile.name.startswith("auto:") and rank == 0:  # a card no profile names: say what is assumed
            print(f"profile {self.profile.name}: {self.profile.description}", file=sys.stderr)
        # the target's weights over the budget: refused before compiling anything (the least any method needs;
        # a caller may plan other methods than the configured one, as bench offload does)
        self.plan(min(self.context, SHORTEST_RUN), replace(config.spec, method="ar"))
        if self.lm.device.type == "cpu":  # compile the decode kernels before the first token, not during it
            from triforce.kernels.cpu import warm
            models = [self.lm] + ([self.draft.model] if self.draft.model is not None else [])
            say = (lambda line: print(line, file=sys.stderr, flush=True)) if rank == 0 else None
            kv_shapes = [(m.config.num_kv_heads, m.config.head_dim) for m in models]
            fresh, steps = warm.fresh(self.lm.dtype, kv_shapes), active() if rank == 0 else None
            # a first start names each compile group as it starts; a later one loads them all in one step
            with nullcontext() if fresh else start_step("loading the compiled CPU kernels", rank):
                warm.warm_up(self.lm.dtype, kv_shapes, say,
                             blocks=partial(warm_up_blocks, self.lm) if self.lm.quantized is not None else None,
                             run_step=steps.run if steps is not None else None)
        elif self.lm.quantized is not None and os.environ.get("TRITON_INTERPRET") != "1":
            warm_up_blocks(self.lm)  # the Triton kernels' specialisations (the interpreter compiles none)
        self.load_s = time.perf_counter() - started
        self._kept: tuple[RunPlan, Engine] | None = None  # the last request's engine (kept_engine)

    def plan_weights(self):
        """A block-quantized model's matrices as the planner counts them (None: floats in --dtype)."""
        q = self.lm.quantized
        if q is None:
            return None
        from triforce.offload.shapes import LoadedBlocks, matrix_weights
        everything = matrix_weights(self.lm.config)
        floats = (everything - q["block_weights"]) * self.lm.dtype.itemsize  # a file's other formats
        return LoadedBlocks(q["weights"], (q["bytes"] + floats) / everything)

    def plan(self, max_len: int, spec: SpecParams | None = None, fixed: frozenset | None = None,
             profile=None) -> RunPlan:
        """The memory plan and the cost model's speculation choices for a context of max_len
        (under `profile`, default the runtime's); a plan that cannot fit is a UserError."""
        c, profile = self.config, profile or self.profile
        spec = spec or c.spec
        draft = self.draft.model if spec.uses_draft else None
        run = plan_run(self.lm.config, profile, max_len, spec, c.fixed if fixed is None else fixed, self.lm.dtype,
                       draft.config if draft else None, draft.dtype if draft else None,
                       has_tier0=self.draft.has_tier0 and spec.uses_draft, weights=self.plan_weights())
        if not run.plan.feasible:
            raise UserError(f"the model does not fit profile {profile.name}: {run.plan.reason}")
        return run

    def engine(self, max_len: int, run: RunPlan | None = None, *, kv_cache=None, replay=None, lm=None, draft: Draft | None = None, graphs: str | None = None,
               draft_ahead: bool | None = None, full=None) -> Engine:
        """The engine for max_len tokens under `run` (default: self.plan(max_len)), over the full
        cache the plan calls for (or kv_cache, or `full`: another engine's full tier), with every
        hook this run has. lm, draft: stand-ins for the loaded ones (a batch's rows call the model
        through triforce.decoding.lockstep); graphs, draft_ahead: instead of the configured settings."""
        from triforce.decoding.sync_count import SyncCounter

        run = run or self.plan(max_len)
        lm = lm or self.lm
        if kv_cache is None and full is None:
            if lm is self.lm:  # a batch checks the room of all its rows at once
                self.check_host_room(run, max_len)
            kv_cache = build_kv_cache(lm, max_len, run.plan, overlap=self.config.overlap, hybrid=self.config.hybrid)
        hooks = EngineHooks(replay=replay,
                            gamma2_controller=run.gamma2_controller(self.draft.has_tier0),
                            # a replayed trace's checks were recorded with the planned gamma1
                            gamma1_controller=run.gamma1_controller(self.draft.has_tier0) if replay is None else None,
                            speculation_gate=run.speculation_gate(),
                            sync_counter=SyncCounter() if self.config.count_syncs else None,
                            **self._rank_agreement())
        draft = (draft or self.draft) if run.spec.uses_draft else None
        # a batch's rows wait for their passes in lanes (greenlets), which a verify thread cannot switch
        draft_ahead = (self.config.draft_ahead if draft_ahead is None else draft_ahead) and lm is self.lm
        return Engine(lm, run.spec, max_len, draft, kv_cache=kv_cache, prefill_chunk=run.plan.prefill_chunk,
                      prefill_group=run.plan.prefill_group, graphs=graphs or self.config.graphs, hooks=hooks,
                      speculate_from=run.speculate_from, draft_ahead=draft_ahead, full=full)

    def kept_engine(self, max_len: int) -> tuple[RunPlan, Engine, bool]:
        """(run, engine, reused): the last request's engine where it has room for max_len, so its
        caches, graphs and the cached prefix of a prompt seen before carry over between requests
        (its plan, made for a longer context, serves a shorter one: auto decodes a short sequence
        as ar all the same); else a new one, built after the old is dropped. A runtime that served
        a request before plans the new one ROOM_STEP tokens roomier, for a conversation's next turn."""
        if self._kept is not None and self._kept[1].max_len >= max_len:
            return (*self._kept, True)
        roomy = min(self.context, -(-max_len // ROOM_STEP) * ROOM_STEP) if self._kept is not None else max_len
        self.drop_engine()
        for length in dict.fromkeys((roomy, max_len)):
            try:
                run = self.plan(length)
                engine = self.engine(length, run)
                break
            except UserError:
                if length == max_len:  # the room beyond the request does not fit: plan for the request alone
                    raise
        self._kept = (run, engine)
        return run, engine, False

    def drop_engine(self) -> None:
        """Free the kept engine (its caches) before another is built, or after a request failed."""
        if self._kept is not None:
            self._kept = None
            import gc
            gc.collect()  # an engine's tiers refer to each other: its device memory goes only with the cycle

    def check_host_room(self, run: RunPlan, max_len: int, rows: int = 1) -> None:
        """The plan's host side (pinned KV store; on a CPU also the 'device' caches and buffers,
        the weights being loaded already), for `rows` rows of a batch, against what the host has
        free now."""
        from triforce.model.host_memory import check_host_room

        plan = run.plan
        needed = plan.host_bytes_total
        if self.lm.device.type == "cpu":
            weights = plan.breakdown.get("target_weights", 0) + plan.breakdown.get("draft_weights", 0)
            needed += plan.gpu_bytes_total - weights
        what = f"the caches and buffers of a {max_len}-token context"
        check_host_room(needed * rows, what if rows == 1 else f"{what} for each of {rows} rows",
                        "a shorter context (--max-context), or a smaller --budget"
                        + ("" if rows == 1 else " or --batch-size"))

    def _rank_agreement(self) -> dict:
        """Under tensor parallelism rank 0's decisions win, and graph capture must succeed on all."""
        if self.world == 1:
            return {}
        from triforce.app.ranks import all_ranks_ok, broadcast_ints

        device = self.lm.device if self.lm.device.type == "cuda" else "cpu"
        return {"agree": partial(broadcast_ints, device=device), "agree_ok": partial(all_ranks_ok, device=device)}

    def say_attention(self) -> None:
        if self.rank == 0:
            print(self.attn_line, file=sys.stderr)


def warm_up_blocks(lm) -> None:
    """Compile (or load from numba's or Triton's cache) the block kernels a quantized model's
    passes take, on a throwaway cache, before the first token: the first answer of a fresh
    install waited for them. CPU: a prefill past SMALL_ROWS and a decoding step. GPU: a pass of
    each row count Triton specialises the kernel for (quant_launch.WARM_ROWS: one row, a few, a
    multiple of 16, and the tall tiles of a prefill), ~10 specialisations a prompt once compiled."""
    from triforce.cache.resident import ResidentKVCache

    if lm.device.type == "cpu":
        from triforce.kernels.cpu.linear.dense import SMALL_ROWS
        counts = (SMALL_ROWS + 1, 1)
    else:
        from triforce.kernels.cuda.quant_launch import WARM_ROWS
        counts = WARM_ROWS
    cache = ResidentKVCache(lm.config, sum(counts), dtype=lm.dtype, device=lm.device, attn=lm.attn)
    start = 0
    for count in counts:
        tokens = torch.zeros(1, count, dtype=torch.int64, device=lm.device)
        positions = torch.arange(start, start + count, device=lm.device)[None]
        lm.model(tokens, positions, cache.step(count))
        start += count


def weights_as(config: RunConfig, device: str, world: int) -> str | None:
    """--quantize resolved: auto runs a .gguf model (the default one too) as its own blocks where
    the block kernels serve (a CPU with FMA, one process) and --dtype was left to auto; None: floats."""
    if config.quantize != "auto":
        return None if config.quantize == "none" else config.quantize
    from triforce.model.loading import resolve_device

    if config.arch is not None or config.dtype != "auto" or resolve_device(device).type != "cpu":
        return None
    return "gguf" if auto_blocks_file(config.model, world) is not None else None


def auto_blocks_file(model: str | None, world: int = 1):
    """The .gguf file whose own blocks --quantize auto runs on a CPU for `model` (with --dtype
    auto): where the block kernels serve (FMA) in one process; None: floats. `plan` asks it too."""
    from triforce.kernels.cpu.simd.f32_dot import HAS_F32_FMA
    from triforce.model.loading import gguf_file

    if model is None or world > 1 or not HAS_F32_FMA:
        return None
    return gguf_file(model)


def build_runtime(config: RunConfig, rank: int = 0, world: int = 1) -> Runtime:
    return Runtime(config, rank, world)


def _load(arch: str | None, model: str | None, dtype: str, device: str, shard, rope_scaling=None, quantize=None,
          required: bool = True):
    from triforce.model.architectures import build_random_model
    from triforce.model.loading import load_model

    if (arch is None) == (model is None):
        raise UserError("give exactly one of a model and an architecture")
    if arch is not None:
        if quantize == "gguf":
            raise UserError("--quantize gguf goes with --model (a .gguf file); random-weight architectures "
                            "take --quantize q8_0/q4_0/q4_1/q4_k")
        return build_random_model(arch, dtype, device, shard=shard, rope_scaling=rope_scaling, quantize=quantize)
    return load_model(model, dtype=dtype, device=device, shard=shard, rope_scaling=rope_scaling, quantize=quantize,
                      quantize_required=required)


def load_draft(name: str, dtype: str, device: str):
    """A draft model: an architecture name (random weights, for timing) or a model path."""
    from triforce.model.architectures import ARCHITECTURES, build_random_model
    from triforce.model.loading import load_model

    if name in ARCHITECTURES:
        return build_random_model(name, dtype, device, seed=1)
    return load_model(name, dtype=dtype, device=device)
