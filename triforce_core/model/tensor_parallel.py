"""Tensor parallelism as a transform of a built (or loading) model, as gpt-fast's tp.py: rank r
keeps a contiguous run of whole KV heads (split as evenly as possible, the first ranks taking one
more when it does not divide: 3 over 2 is 2 + 1) and the query heads that share them, so each rank's
attention and its KV cache are self-contained. q/k/v and gate/up keep their rows of the rank's share,
o and down their columns, followed by an all-reduce. Embeddings, norms and the LM head stay whole on
every rank, so every rank ends with the same logits. Starting the ranks and the collectives the
decoding loop needs are triforce.app.ranks'."""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch import nn

from triforce.errors import UserError
from triforce.kernels.cpu.linear.dense import linear as cpu_linear

def even_split(total: int, world: int) -> list[tuple[int, int]]:
    """(start, count) of each rank's share of `total` items; earlier ranks take the remainder."""
    if world > total:
        raise UserError(f"cannot split {total} KV heads over {world} ranks (--tp at most {total})")
    base, extra = divmod(total, world)
    shares, start = [], 0
    for rank in range(world):
        count = base + (rank < extra)
        shares.append((start, count))
        start += count
    return shares


@dataclass(frozen=True)
class Shard:
    rank: int
    world: int
    kv_heads: tuple[int, int]        # (first, count) of this rank's KV heads
    intermediate: tuple[int, int]    # (first, count) of this rank's MLP rows


class RowParallelLinear(nn.Module):
    """y = all_reduce(x @ W[:, cols].T) + bias: the input-split half of a sharded pair."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = cpu_linear(x, self.weight)  # the small-rows CPU kernels while decoding (weights load later)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(out)
        return out if self.bias is None else out + self.bias


def _rows(linear: nn.Linear, start: int, count: int) -> nn.Linear:
    sliced = nn.Linear(linear.in_features, count, bias=linear.bias is not None,
                       device=linear.weight.device, dtype=linear.weight.dtype)
    with torch.no_grad():
        sliced.weight.copy_(linear.weight[start:start + count])
        if linear.bias is not None:
            sliced.bias.copy_(linear.bias[start:start + count])
    return sliced.requires_grad_(False)


def _cols(linear: nn.Linear, start: int, count: int) -> RowParallelLinear:
    return RowParallelLinear(linear.weight[:, start:start + count].contiguous().clone(),
                             None if linear.bias is None else linear.bias.clone())


def share_ranges(cfg, rank: int, world: int) -> tuple[dict, dict, Shard]:
    """(rows, cols, shard): the (start, count) of output rows, by projection name, and of input
    columns that rank `rank` keeps; one source for cutting a built model and for slicing a
    checkpoint while loading."""
    kv_start, kv_count = even_split(cfg.num_kv_heads, world)[rank]
    inter = even_split(cfg.intermediate_size, world)[rank]
    groups, dim = cfg.num_heads // cfg.num_kv_heads, cfg.head_dim
    q_rows, kv_rows = (kv_start * groups * dim, kv_count * groups * dim), (kv_start * dim, kv_count * dim)
    rows = {"q_proj": q_rows, "k_proj": kv_rows, "v_proj": kv_rows, "gate_proj": inter, "up_proj": inter}
    cols = {"o_proj": q_rows, "down_proj": inter}
    return rows, cols, Shard(rank, world, (kv_start, kv_count), inter)


def shard_model(model: nn.Module, rank: int, world: int) -> Shard:
    """Cut a built decoder (layers with self_attn.{q,k,v,o}_proj and mlp.{gate,up,down}_proj) down
    to rank `rank`'s share, in place. Returns the share."""
    cfg = model.config
    rows, cols, shard = share_ranges(cfg, rank, world)
    groups = cfg.num_heads // cfg.num_kv_heads
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for parent in (attn, mlp):
            for name, (start, count) in rows.items():
                if hasattr(parent, name):
                    setattr(parent, name, _rows(getattr(parent, name), start, count))
            for name, (start, count) in cols.items():
                if hasattr(parent, name):
                    setattr(parent, name, _cols(getattr(parent, name), start, count))
        attn.num_heads, attn.num_kv_heads = shard.kv_heads[1] * groups, shard.kv_heads[1]
        if rank != 0:  # biases of the reduced projections are added once, after the sum
            attn.o_proj.bias = None
            mlp.down_proj.bias = None
    if getattr(model, "kernels", None) == "fused":  # a loaded model: fuse the share, not the whole
        model.use_kernels("fused")
    return shard


def shard_slicer(cfg, rank: int, world: int):
    """slice(name, tensor) -> the part of a whole checkpoint tensor that rank `rank` keeps after
    shard_model (None: the rank keeps none of it), so a rank slices each tensor on the host and
    never holds the whole model on its device."""
    rows, cols, _ = share_ranges(cfg, rank, world)

    def slice_for_rank(name: str, tensor: torch.Tensor) -> torch.Tensor | None:
        module, _, kind = name.rpartition(".")
        proj = module.rpartition(".")[2]
        if proj in rows:
            start, count = rows[proj]
            return tensor.narrow(0, start, count)
        if proj in cols:
            if kind == "bias":  # added once, after the all-reduce
                return tensor if rank == 0 else None
            start, count = cols[proj]
            return tensor.narrow(1, start, count)
        return tensor

    return slice_for_rank




def shard_meta_model(model, rank: int, world: int):
    """Cut a model (built on the meta device, or loaded) to rank `rank`'s heads and MLP rows; its
    config then describes the share (the caches it builds hold only those KV heads)."""
    cfg = model.config
    shard = shard_model(model, rank, world)
    groups = cfg.num_heads // cfg.num_kv_heads
    model.config = replace(cfg, num_heads=shard.kv_heads[1] * groups, num_kv_heads=shard.kv_heads[1],
                           intermediate_size=shard.intermediate[1])
    return model
