"""Running the verifier over several GPUs (or several CPU processes with gloo): each rank loads
the model, cuts it to its share (triforce.model.sharding), and runs the same engine on its own heads'
KV. Every rank reaches the same logits; decisions are broadcast from rank 0 all the same."""
from __future__ import annotations

import os

import torch


def rank_device(device: str, rank: int) -> str:
    """cuda:<rank> for a CUDA run, else the CPU."""
    if device in ("auto", "cuda") and torch.cuda.is_available():
        return f"cuda:{rank}"
    return "cpu" if device == "auto" else device


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
