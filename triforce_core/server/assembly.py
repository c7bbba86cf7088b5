"""`triforce serve`'s assembly: load the model, size the batch, build the API and run uvicorn on a
listening socket; under tensor parallelism rank 0 serves and the other ranks follow."""
from __future__ import annotations

import signal
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

from triforce.config import RunConfig
from triforce.errors import UserError

DEFAULT_MAX_ROWS = 4  # rows decoded together unless --batch-size says otherwise (each row slows the others)


@dataclass(frozen=True)
class ServeRequest:
    """What every rank of `serve --tp` needs (picklable)."""
    config: RunConfig
    host: str
    port: int
    api_key: str | None
    model_name: str | None
    queue_size: int
    quiet: bool
    origins: tuple
    hosts: frozenset | None = None


def serve_rank(rank: int, world: int, r: ServeRequest) -> None:
    """Rank 0 serves (triforce.server.tp.lead_requests); the others follow its requests."""
    if rank == 0:
        run_server(r.config, listen(r.host, r.port), r.api_key, r.model_name, 1, r.queue_size, r.quiet,
                   r.origins, rank, world, r.hosts)
        return
    from triforce.app.batch_generate import fit_batch
    from triforce.app.llm import LLM
    from triforce.server.tp import follow_requests

    runtime = LLM.from_config(r.config, rank, world).runtime
    follow_requests(runtime, fit_batch(runtime, runtime.context, 1, 1)[1], runtime.context)


def listen(host: str, port: int) -> socket.socket:
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        return socket.create_server((host, port), family=family, backlog=128)
    except OSError as e:
        raise UserError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


def build_api(config: RunConfig, api_key=None, model_name=None, batch_size=None, queue_size=16, quiet=False,
              origins=(), rank: int = 0, world: int = 1, hosts: frozenset | None = None):
    """Load the model, size the batch and build the API: (Api, the lines to print at start).
    hosts: the Host names answered (triforce.server.guard.allowed_hosts; None: any)."""
    from triforce.app.batch_generate import fit_batch
    from triforce.app.llm import LLM
    from triforce.server.app import Api
    from triforce.server.scheduler import Scheduler

    runtime = LLM.from_config(config, rank, world).runtime
    context = runtime.context
    rows, run = fit_batch(runtime, context, batch_size or DEFAULT_MAX_ROWS, batch_size)
    runtime.check_host_room(run, context, rows)
    scheduler = Scheduler(runtime, run, context, rows, queue_size, log=not quiet)
    model_id = model_name or Path(str(runtime.lm.path)).name
    lines = [runtime.attn_line] + ([run.method_line()] if run.method_line() is not None else [])
    if scheduler.lone_run is not None:
        lines.append(f"for a request alone, {scheduler.lone_run.method_line()}")
    parallel = f", tensor-parallel over {world} ranks" if world > 1 else ""
    from triforce.app.threads import threads_in_use

    from triforce.model.sampling_defaults import model_sampling

    lines.append(f"{model_sampling(runtime.lm).describe()}, where a request leaves a field out")
    lines.append(f"triforce serve: {model_id}, method {run.spec.method}, {rows} row(s) at once, "
                 f"{context}-token context, {threads_in_use()} CPU threads{parallel}")
    return Api(runtime.lm, scheduler, model_id, context, api_key, origins,
               parse_special=config.parse_special_tokens, hosts=hosts), lines


def run_server(config: RunConfig, listener: socket.socket, api_key, model_name, batch_size, queue_size,
               quiet: bool, origins=(), rank: int = 0, world: int = 1, hosts: frozenset | None = None) -> None:
    import uvicorn

    api, lines = build_api(config, api_key, model_name, batch_size, queue_size, quiet, origins, rank, world, hosts)
    address, port = listener.getsockname()[:2]
    shown = f"[{address}]" if ":" in address else address
    lines[-1] += (f"; listening on http://{shown}:{port}/v1, a chat page at http://{shown}:{port}/ "
                  "(Ctrl-C or SIGTERM to stop)")
    server = uvicorn.Server(uvicorn.Config(api.app(), log_level="warning", timeout_graceful_shutdown=None))
    # uvicorn listens for signals only on the main thread, where the rows decode (Scheduler.serve_here);
    # set before the "listening" line, which is what a user (or a test) waits for before Ctrl-C
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, server.handle_exit)
    print("\n".join(lines), file=sys.stderr, flush=True)
    api.scheduler.serve_here(lambda: server.run(sockets=[listener]))
    print("triforce serve: stopped", file=sys.stderr)
