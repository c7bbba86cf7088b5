"""Tensor-parallel ranks: starting one process per rank (torch.multiprocessing, a gloo or NCCL
process group), ending them all when one fails or the parent dies, and the two collectives the
decoding loop needs (all ranks agree; rank 0's integers everywhere). The model's sharding is
triforce.model.tensor_parallel's."""
from __future__ import annotations

import os
import sys
from typing import Callable

import torch
import torch.distributed as dist


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
def collective_timeout_s() -> float:
    """How long a rank waits in one collective before giving up (TRIFORCE_TP_TIMEOUT_S, default 900
    s): a rank that died mid-pass is noticed then. An idle rank never waits this long: rank 0 sends
    a heartbeat while it waits for the next request or chat line (triforce.app.rank_idle)."""
    return float(os.environ.get("TRIFORCE_TP_TIMEOUT_S", "900"))


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
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(seconds=collective_timeout_s()),
                            device_id=device_id)


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


def backend_for(world: int) -> str:
    """NCCL where every rank has a GPU of its own; gloo on CPUs, and for ranks sharing one card
    (app.parallel.ranks_share_a_card)."""
    return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= world else "gloo"


class RankFailed(RuntimeError):
    """A rank raised; the others were stopped. The message names the rank and its error."""


def launch(world: int, fn: Callable, args: tuple = (), *, backend: str | None = None) -> None:
    """Run fn(rank, world, *args) on `world` ranks joined by torch.distributed (gloo on CPU, NCCL
    on CUDA): rank 0 in this process (it keeps the terminal), ranks 1.. in child processes. When
    a rank fails, the others are stopped: a worker's failure is raised as RankFailed naming the
    rank and its error; rank 0's own error is raised as it is."""
    import socket

    import torch.multiprocessing as mp

    backend = backend or backend_for(world)
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
