"""Running the verifier over several GPUs (or several CPU processes with gloo): each rank loads
the model, cuts it to its share (triforce.offload.tp), and runs the same engine on its own heads'
KV. Every rank reaches the same logits; decisions are broadcast from rank 0 all the same."""
from __future__ import annotations

import os
from dataclasses import replace
from functools import partial

import torch

from triforce.offload.tp import all_ranks_ok, broadcast_ints, shard_model


def rank_device(device: str, rank: int) -> str:
    """cuda:<rank> for a CUDA run, else the CPU."""
    if device in ("auto", "cuda") and torch.cuda.is_available():
        return f"cuda:{rank}"
    return "cpu" if device == "auto" else device


def shard_meta_model(model, rank: int, world: int):
    """Cut a model (built on the meta device, or loaded) to rank `rank`'s heads and MLP rows; its
    config then describes the share (the caches it builds hold only those KV heads)."""
    cfg = model.config
    shard = shard_model(model, rank, world)
    groups = cfg.num_heads // cfg.num_kv_heads
    model.config = replace(cfg, num_heads=shard.kv_heads[1] * groups, num_kv_heads=shard.kv_heads[1],
                           intermediate_size=shard.intermediate[1])
    return model



def agree_across_ranks(engine, device) -> None:
    """Make the engine take rank 0's decisions (accepted counts, sampled tokens)."""
    engine.agree = partial(broadcast_ints, device=device)
    for tier in engine.levels:
        runner = getattr(tier, "runner", None)
        if runner is not None:  # graph capture succeeds on every rank or on none
            runner.agree = partial(all_ranks_ok, device=device)


def share_threads(world: int) -> None:
    """CPU ranks split the cores instead of each taking all of them."""
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))


def run_on_ranks(world: int, fn, request, model: str | None = None) -> None:
    """Run fn(rank, world, request) on `world` ranks (in this process alone when world is 1); a
    failing rank becomes one UserError line. `model` is fetched or converted once first, so the
    ranks do not race to do it."""
    if world == 1:
        fn(0, 1, request)
        return
    from triforce.errors import UserError
    from triforce.offload.tp import RankFailed, launch

    if model is not None:
        from triforce.model.loading import resolve_model_dir
        resolve_model_dir(model)
    try:
        launch(world, fn, (request,))
    except RankFailed as e:
        raise UserError(str(e)) from None
