"""Functions tensor-parallel test ranks run (they must live in an importable module: ranks are
fresh processes)."""
import torch


def save_logits_rank(rank: int, world: int, model_dir: str, ids: list[int], out_path: str) -> None:
    from triforce.cache.resident import ResidentKVCache
    from triforce.model.loading import load_model

    torch.set_num_threads(1)
    lm = load_model(model_dir, dtype="float64", device="cpu", shard=(rank, world))  # sliced while loading
    cache = ResidentKVCache(lm.config, len(ids), dtype=lm.dtype)
    step = cache.step(len(ids))
    logits = lm.model(torch.tensor([ids]), step.positions, step)
    if rank == 0:
        torch.save({"logits": logits, "kv_heads": lm.config.num_kv_heads}, out_path)
