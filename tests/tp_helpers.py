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


def orphan_rank(rank: int, world: int, folder: str) -> None:
    """Rank 1 says its pid and waits forever; rank 0 waits for that, then dies by SIGKILL (as
    a parent killed by the out-of-memory killer or `kill -9` would)."""
    import os
    import pathlib
    import signal
    import time

    marker = pathlib.Path(folder) / "worker.pid"
    if rank == 1:
        # torch's spawn sends SIGINT when the parent dies, which a chat rank takes for Ctrl-C
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        # written aside and renamed: rank 0 must never see the file before its pid is in it
        partial = marker.with_suffix(".partial")
        partial.write_text(str(os.getpid()))
        partial.rename(marker)
        while True:
            time.sleep(1)
    while not marker.exists():
        time.sleep(0.05)
    os.kill(os.getpid(), signal.SIGKILL)
