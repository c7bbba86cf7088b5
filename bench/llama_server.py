"""llama.cpp's llama-server as the peer of `triforce bench serve-ttft --llama-server`: started on
the same GGUF file with the same context, RoPE stretch and threads as our server, one slot (its
prompt cache keeps a conversation's prefix, as our rows do), on a free loopback port, and stopped
when the conversation is done."""
from __future__ import annotations

import contextlib
import socket
import subprocess
import tempfile
import time
from typing import Iterator

import click
import httpx

START_S = 600.0  # loading a GGUF takes seconds; a flag it refuses ends the process at once
LLAMA_SCALINGS = ("yarn", "linear")  # the --rope-scaling kinds llama-server shares with ours


def server_flags(gguf: str, context: int, threads: int, rope_scaling: str | None, trained: int) -> list[str]:
    """llama-server's flags for our server's settings (trained: the model's own context)."""
    flags = ["-m", gguf, "-c", str(context), "-np", "1", "-t", str(threads), "-tb", str(threads)]
    if rope_scaling is not None:
        if rope_scaling not in LLAMA_SCALINGS:
            raise click.UsageError(f"llama-server has no --rope-scaling {rope_scaling} (it has "
                                   f"{', '.join(LLAMA_SCALINGS)})")
        flags += ["--rope-scaling", rope_scaling, "--rope-scale", f"{context / trained:g}"]
    return flags


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def llama_server(binary: str, flags: list[str]) -> Iterator[str]:
    """Run `binary flags` on a free loopback port until the block ends; yields its URL once its
    /health answers 200. A server that exits first is a ClickException with the end of its log."""
    port = _free_port()
    with tempfile.TemporaryFile("w+") as log:
        try:
            proc = subprocess.Popen([binary, *flags, "--host", "127.0.0.1", "--port", str(port)],
                                    stdout=log, stderr=subprocess.STDOUT)
        except OSError as e:
            raise click.ClickException(f"cannot run llama-server {binary}: {e.strerror or e}") from None
        url = f"http://127.0.0.1:{port}"
        try:
            _wait_healthy(proc, url, log)
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _wait_healthy(proc: subprocess.Popen, url: str, log) -> None:
    ends = time.monotonic() + START_S
    while time.monotonic() < ends:
        if proc.poll() is not None:
            log.seek(0)
            tail = " | ".join(log.read().strip().splitlines()[-3:])
            raise click.ClickException(f"llama-server exited with code {proc.returncode}: {tail}")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise click.ClickException(f"llama-server did not answer on {url}/health within {START_S:.0f} s")
