"""A model cut to one tensor-parallel rank's share while it is built or loaded (the transform
itself is triforce.offload.tp's)."""
from __future__ import annotations

from dataclasses import replace

from triforce.offload.tp import shard_model


def shard_meta_model(model, rank: int, world: int):
    """Cut a model (built on the meta device, or loaded) to rank `rank`'s heads and MLP rows; its
    config then describes the share (the caches it builds hold only those KV heads)."""
    cfg = model.config
    shard = shard_model(model, rank, world)
    groups = cfg.num_heads // cfg.num_kv_heads
    model.config = replace(cfg, num_heads=shard.kv_heads[1] * groups, num_kv_heads=shard.kv_heads[1],
                           intermediate_size=shard.intermediate[1])
    return model
