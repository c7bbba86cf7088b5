"""Tensor parallelism for the verifier: a transform applied to a built model, plus starting and
stopping the ranks.

Sharding follows whole KV heads: rank r keeps a contiguous run of KV heads (split as evenly as
possible, the first ranks taking one more when it does not divide: 3 over 2 is 2 + 1) and the
query heads that share them, so each rank's attention and its KV cache are self-contained. q/k/v
and gate/up keep their rows of the rank's share, o and down their columns, followed by an
all-reduce. Embeddings, norms and the LM head stay whole on every rank, so every rank ends with
the same logits and takes the same decisions (which are also broadcast from rank 0)."""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from triforce.kernels.cpu_linear import linear as cpu_linear
from triforce.offload.errors import OffloadError

FAIL_RANK_ENV = "TRIFORCE_TP_FAIL_RANK"  # tests: make this rank fail after it starts


def even_split(total: int, world: int) -> list[tuple[int, int]]:
    """(start, count) of each rank's share of `total` items; earlier ranks take the remainder."""
    if world > total:
        raise OffloadError(f"cannot split {total} KV heads over {world} ranks (--tp at most {total})")
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


def all_ranks_ok(ok: bool, device: torch.device | str = "cpu") -> bool:
    """True on every rank when `ok` is true on every rank (a no-op without a process group)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return ok
    flag = torch.tensor([int(ok)], dtype=torch.int64, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def broadcast_ints(values: list[int], device: torch.device | str = "cpu") -> list[int]:
    """Rank 0's values on every rank (a fixed number of ints every rank knows: a verdict's
    accepted count and token, a sampled token). A no-op without a process group."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return values
    tensor = torch.tensor(values, dtype=torch.int64, device=device)
    dist.broadcast(tensor, src=0)
    return tensor.tolist()


# ---- starting and stopping ranks --------------------------------------------------------
RENDEZVOUS_TIMEOUT_S = 900  # a rank waiting this long in a collective gives up


def select_rank_device(rank: int, backend: str) -> torch.device | None:
    """NCCL ranks make cuda:<rank> their current device before anything touches CUDA, so NCCL
    communicators, Triton launches and graph captures of each rank land on its own GPU (without
    this every rank runs on cuda:0). gloo ranks keep the CPU."""
    if backend != "nccl":
        return None
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    return device


def _join(rank: int, world: int, port: int, backend: str) -> None:
    from datetime import timedelta

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device_id = select_rank_device(rank, backend)
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(seconds=RENDEZVOUS_TIMEOUT_S),
                            device_id=device_id)
    if os.environ.get(FAIL_RANK_ENV) == str(rank):
        raise RuntimeError(f"rank {rank} was told to fail ({FAIL_RANK_ENV})")


def _die_with(parent: int) -> None:
    """A worker must not outlive rank 0 (orphans once kept ~23 GB after the parent was killed):
    Linux kills it when the parent goes (PR_SET_PDEATHSIG); elsewhere, and for a parent gone
    before that was set, a daemon thread watches the parent's pid."""
    import signal
    import threading
    import time

    if sys.platform.startswith("linux"):
        import ctypes
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass

    def watch():
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="parent-watch").start()


def _worker_main(index: int, world: int, port: int, backend: str, fn: Callable, args: tuple,
                 parent: int) -> None:
    _die_with(parent)
    rank = index + 1
    _join(rank, world, port, backend)
    fn(rank, world, *args)  # on an exception the process just ends: rank 0 notices and stops the rest
    dist.barrier()  # every rank is done
    # Leave without tearing the process group down: gloo's connection threads abort a process
    # whose peer closes first ("terminate called without an active exception"), so a worker
    # exits at once and rank 0, which lives on, tears its side down after the workers are gone.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class RankFailed(RuntimeError):
    """A rank raised; the others were stopped. The message names the rank and its error."""


def launch(world: int, fn: Callable, args: tuple = (), *, backend: str | None = None) -> None:
    """Run fn(rank, world, *args) on `world` ranks joined by torch.distributed (gloo on CPU, NCCL
    on CUDA): rank 0 in this process (it keeps the terminal), ranks 1.. in child processes. When
    a rank fails, the others are stopped: a worker's failure is raised as RankFailed naming the
    rank and its error; rank 0's own error is raised as it is."""
    import socket

    import torch.multiprocessing as mp

    backend = backend or ("nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= world else "gloo")
    with socket.socket() as s:  # a free port for the rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    workers = mp.start_processes(_worker_main, args=(world, port, backend, fn, args, os.getpid()), nprocs=world - 1,
                                 join=False, start_method="spawn")
    threads = torch.get_num_threads()  # rank 0 may share out the cores; this process goes on after
    try:
        _join(0, world, port, backend)
        fn(0, world, *args)
        dist.barrier()
    except BaseException:
        worker_error = _worker_failure(workers)
        _stop(workers)
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # a dead peer can make teardown complain; the process goes on
                pass
        if worker_error is not None:
            raise worker_error from None
        raise
    finally:
        torch.set_num_threads(threads)
    failure = None
    while failure is None and not all(not p.is_alive() for p in workers.processes):
        failure = _worker_failure(workers)
    failure = failure or _worker_failure(workers)
    if failure is not None:
        _stop(workers)
    dist.destroy_process_group()
    if failure is not None:
        raise failure


def _worker_failure(workers) -> RankFailed | None:
    """The first worker that failed, if any (waiting briefly for one that is dying)."""
    import torch.multiprocessing as mp

    try:
        workers.join(timeout=5)
    except mp.ProcessRaisedException as e:
        lines = [line for line in str(e).strip().splitlines() if line.strip()]
        return RankFailed(f"rank {e.error_index + 1} failed: {lines[-1] if lines else e}; "
                          "the other ranks were stopped")
    except mp.ProcessExitedException as e:
        return RankFailed(f"rank {e.error_index + 1} exited with code {e.exit_code}; the other ranks were stopped")
    return None


def _stop(workers) -> None:
    for process in workers.processes:
        if process.is_alive():
            process.terminate()
    for process in workers.processes:
        process.join(timeout=10)
