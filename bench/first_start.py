"""How long a user waits the first time: `triforce chat` answering one question on an empty
numba cache (every kernel compiled), then again with the cache filled, and where the compile
time goes (each kernel group's warm-up, timed in a child process of its own).

    python -m triforce.bench.first_start [--dtype float32] [--question "..."]

Each run gets a fresh NUMBA_CACHE_DIR in a temporary folder, so the user's own cache is neither
used nor touched. Issue 15 asks for a first start under ~30 s. The groups are timed one after
the other; chat compiles the attention kernel in a child beside the others where it has two
cores (triforce.kernels.cpu.warm), so its first start is less than their sum."""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

import click

_WARM_UPS = """
import sys, time, torch
dtype = getattr(torch, sys.argv[1])
from triforce.kernels.cpu import cpu_attention, cpu_layer, cpu_linear
for name, module in (("linear", cpu_linear), ("attention", cpu_attention), ("layer", cpu_layer)):
    start = time.perf_counter()
    module.warm_up(dtype)
    print(name, round(time.perf_counter() - start, 2))
"""


def _chat(question: str, dtype: str, cache: str) -> tuple[float, str]:
    """Wall seconds of one `triforce chat` session that asks `question` and quits, and its answer."""
    env = dict(os.environ, NUMBA_CACHE_DIR=cache)
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "triforce.cli.main", "chat", "--temperature", "0", "--dtype", dtype],
                          input=f"{question}\n/quit\n", env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise click.ClickException(f"triforce chat failed (exit {done.returncode}): {done.stderr.strip()[-400:]}")
    answer = next((line for line in done.stdout.splitlines() if line.startswith(">>> ") and len(line) > 4), "")
    return seconds, answer.removeprefix(">>> ")


@click.command()
@click.option("--dtype", type=click.Choice(["float32", "bfloat16"]), default="float32", show_default=True)
@click.option("--question", default="What is the capital of France?", show_default=True)
def main(dtype: str, question: str) -> None:
    with tempfile.TemporaryDirectory(prefix="triforce-first-start-") as folder:
        cold, answer = _chat(question, dtype, os.path.join(folder, "chat"))
        warm, _ = _chat(question, dtype, os.path.join(folder, "chat"))
        env = dict(os.environ, NUMBA_CACHE_DIR=os.path.join(folder, "kernels"))
        parts = subprocess.run([sys.executable, "-c", _WARM_UPS, dtype], env=env, capture_output=True, text=True, check=True)
    print(f"triforce chat, {dtype}, one question ({answer!r}):")
    print(f"  first start (empty kernel cache): {cold:.1f} s")
    print(f"  next start (kernels cached):      {warm:.1f} s")
    print("  compile time per kernel group, empty cache: "
          + ", ".join(f"{name} {seconds} s" for name, seconds in (line.split() for line in parts.stdout.splitlines())))


if __name__ == "__main__":
    main()
