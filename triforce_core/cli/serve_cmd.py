"""`triforce serve`: an OpenAI-compatible server on the loopback (see triforce.server)."""
from __future__ import annotations

import sys

import click

from triforce.cli.options import INT, run_config, run_options
from triforce.errors import UserError
from triforce.server.assembly import DEFAULT_MAX_ROWS



@click.command()
@run_options(default_method="auto", special_tokens=True)
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on (0.0.0.0 opens the server to the network: set --api-key).")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True,
              help="Port to listen on (0: any free port, printed at start).")
@click.option("--api-key", default=None, envvar="TRIFORCE_API_KEY",
              help="Require 'Authorization: Bearer KEY' on /v1 (also from $TRIFORCE_API_KEY).")
@click.option("--model-name", default=None,
              help="The model id /v1/models lists and answers carry (default: the model folder's name). "
                   "Requests may name any model: this server has one.")
@click.option("--allow-origin", "origins", multiple=True,
              help="A web page origin (e.g. http://localhost:3000, or *) whose scripts may call the API "
                   "from a browser (CORS); repeatable. Default: none.")
@click.option("--allow-host", "extra_hosts", multiple=True,
              help="A Host name to answer besides localhost, 127.0.0.1 and ::1 when listening on a loopback "
                   "address (a server bound there refuses other names: DNS rebinding); repeatable.")
@click.option("--batch-size", type=INT, default=None,
              help=f"Requests decoded together, sharing each forward pass (default: as many as the memory "
                   f"plan fits, at most {DEFAULT_MAX_ROWS}).")
@click.option("--queue-size", type=INT, default=16, show_default=True,
              help="Requests that may wait for a free row; beyond that the server answers 503.")
@click.option("--tp", type=INT, default=1, show_default=True,
              help="Tensor-parallel ranks: the verifier's heads and KV split over N GPUs (gloo processes on a "
                   "CPU); requests then decode one at a time. Idle ranks are kept alive; a rank stuck in one "
                   "step for TRIFORCE_TP_TIMEOUT_S (900 s) fails.")
@click.option("--quiet", is_flag=True, help="No line per request on stderr.")
def serve(host, port, api_key, model_name, origins, extra_hosts, batch_size, queue_size, tp, quiet, **flags):
    """Serve the model over OpenAI's API: /v1/chat/completions, /v1/completions (streamed as
    server-sent events with "stream": true), /v1/models and /health.

    Open http://HOST:PORT/ in a browser for a chat page, or point a chat UI or the openai client
    at http://HOST:PORT/v1. Chat messages go through the
    model's chat template exactly as `generate --chat`. Requests that arrive together decode
    together (up to --batch-size, the rest wait in the queue); each keeps its cache afterwards,
    so the next turn of a conversation prefills only what is new (usage.prompt_tokens_details.
    cached_tokens says how much was reused). A client that disconnects stops its generation.
    Ctrl-C or SIGTERM lets the answers in flight finish, then exits.
    """
    if queue_size < 0:
        raise UserError(f"--queue-size must be >= 0, got {queue_size}")
    if batch_size is not None and batch_size < 1:
        raise UserError(f"--batch-size must be >= 1, got {batch_size}")
    if api_key is not None and not api_key.strip():
        raise UserError("--api-key is empty")
    if tp < 1:
        raise UserError(f"--tp must be >= 1, got {tp}")
    if tp > 1 and batch_size not in (None, 1):
        raise UserError("--tp decodes one request at a time: leave out --batch-size (or give 1)")
    from triforce.server.assembly import ServeRequest, listen, run_server, serve_rank

    listener = listen(host, port)  # a port in use fails now, not after loading the model
    from triforce.server.guard import allowed_hosts, network_warning

    bound = listener.getsockname()[0]
    hosts = allowed_hosts(bound, tuple(extra_hosts))
    warning = network_warning(bound, api_key)
    if warning:
        print(warning, file=sys.stderr, flush=True)
    config = run_config(flags)
    if tp == 1:
        run_server(config, listener, api_key, model_name, batch_size, queue_size, quiet, origins, hosts=hosts)
        return
    from triforce.app.parallel import run_on_ranks

    host, port = listener.getsockname()[:2]  # rank 0 listens again on the port found free here
    listener.close()
    request = ServeRequest(config, host, port, api_key, model_name, queue_size, quiet, tuple(origins), hosts)
    run_on_ranks(tp, serve_rank, request, config.model, config.device)
