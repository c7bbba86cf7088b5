"""Running the verifier over several GPUs (or several CPU processes with gloo): each rank loads
the model, cuts it to its share (triforce.model.tensor_parallel), and runs the same engine on its own heads'
KV. Every rank reaches the same logits; decisions are broadcast from rank 0 all the same."""
from __future__ import annotations

import os

import torch


def rank_device(device: str, rank: int) -> str:
    """cuda:<rank> for a CUDA run, else the CPU (check_world refuses one named card for several ranks)."""
    if device in ("auto", "cuda") and torch.cuda.is_available():
        return f"cuda:{rank}"
    return "cpu" if device == "auto" else device


def share_threads(world: int, threads: int | None = None) -> None:
    """CPU ranks split the cores (or --threads) instead of each taking all of them (torch's
    threads and the numba kernels' alike)."""
    from triforce.app.threads import available_cores, use_threads

    use_threads(max(1, (threads or available_cores()) // world))


def run_on_ranks(world: int, fn, request, model: str | None = None, device: str = "auto",
                 arch: str | None = None) -> None:
    """Run fn(rank, world, request) on `world` ranks (in this process alone when world is 1); a
    failing rank becomes one UserError line. Before any rank starts, `world` is checked against
    the model's KV heads and the GPUs or cores there are, and `model` is fetched or converted once,
    so the ranks neither race to do it nor start only to fail."""
    if world == 1:
        fn(0, 1, request)
        return
    from triforce.errors import UserError
    from triforce.app.ranks import RankFailed, launch

    check_world(world, device, model, arch)
    try:
        launch(world, fn, (request,))
    except RankFailed as e:
        raise UserError(str(e)) from None


def ranks_share_a_card() -> bool:
    """TRIFORCE_TP_ONE_CARD=1: more ranks than GPUs run on the one card, joined by gloo (NCCL
    refuses two ranks on one device). For checking the tensor-parallel path's CUDA side where a
    machine has one GPU (the GPU campaign's tp2-one-card step); its speed means nothing."""
    return os.environ.get("TRIFORCE_TP_ONE_CARD") == "1"


def check_world(world: int, device: str, model: str | None = None, arch: str | None = None) -> None:
    """--tp N must split the model's KV heads and fit the GPUs (CUDA) or cores (CPU) present."""
    from triforce.errors import UserError

    if world < 1:
        raise UserError(f"--tp must be >= 1, got {world}")
    if world > 1 and device.startswith("cuda:"):
        raise UserError(f"--device {device} names one card, but --tp {world} runs rank N on cuda:N: "
                        "use --device cuda (or auto)")
    on_cuda = torch.cuda.is_available() and device in ("auto", "cuda")
    if on_cuda and world > torch.cuda.device_count() and not ranks_share_a_card():
        raise UserError(f"--tp {world} needs {world} GPUs but {torch.cuda.device_count()} are visible")
    if on_cuda and world <= torch.cuda.device_count():  # NCCL between cards (ranks on one card use gloo)
        check_shared_memory(world)
    cores = os.cpu_count() or 1
    if not on_cuda and world > cores:
        raise UserError(f"--tp {world} on the CPU needs a core per rank but this machine has {cores}")
    kv_heads = None
    if arch is not None:
        from triforce.model.architectures import arch_config
        kv_heads = arch_config(arch).num_kv_heads
    elif model is not None:
        from triforce.model.hf_config import read_hf_config
        from triforce.model.loading import resolve_model_dir
        hf = read_hf_config(resolve_model_dir(model))
        kv_heads = getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads
    if kv_heads is not None and world > kv_heads:
        raise UserError(f"--tp {world} cannot split the model's {kv_heads} KV heads (--tp at most {kv_heads})")


SHM_NEEDED_BYTES = 512 << 20  # NCCL's shared-memory buffers for a few ranks (Docker's default is 64 MB)


def check_shared_memory(world: int, can_access_peer=None, shm_path: str = "/dev/shm",
                        needed_bytes: int | None = None) -> None:
    """Cards that cannot reach each other directly (two 4090s: no P2P) make NCCL pass data through
    shared memory, which fails mid-start where /dev/shm is small (a container's default): refused
    here in one line naming the fix. can_access_peer: torch.cuda.can_device_access_peer."""
    from triforce.errors import UserError

    can_access_peer = can_access_peer or torch.cuda.can_device_access_peer
    needed_bytes = SHM_NEEDED_BYTES if needed_bytes is None else needed_bytes
    if world < 2 or all(can_access_peer(a, b) for a in range(world) for b in range(world) if a != b):
        return
    try:
        stats = os.statvfs(shm_path)
    except OSError as e:
        raise UserError(f"--tp {world}: these cards reach each other through shared memory, but {shm_path} is not "
                        f"usable ({e.strerror}); in a container, run it with --ipc=host or --shm-size=1g") from None
    free = stats.f_bavail * stats.f_frsize
    if free < needed_bytes:
        raise UserError(f"--tp {world}: these cards reach each other through shared memory, and {shm_path} has "
                        f"{free >> 20} MiB free of the {needed_bytes >> 20} MiB NCCL needs; in a container, run it "
                        "with --ipc=host or --shm-size=1g")
