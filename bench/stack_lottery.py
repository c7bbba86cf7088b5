"""Does a kernel's speed depend on where the process's stack happens to start?

    python -m triforce.bench.stack_lottery [--pads 0,16,32,48] [--repeats 200]

Each kernel (one attention job's scores, softmax and weighted values at `--rows` query rows over 512
keys; the bfloat16 linear kernel at 1 and 4 rows on cache-resident weights; the whole attention
call) is timed in child processes that differ only in the size of one environment variable,
which shifts the stack by that many bytes. Address-space randomisation is switched off for the
children (`setarch -R`, util-linux) so the shift is the only difference; where setarch is
missing each pad runs three times with randomisation and the spread shows the same lottery.
A kernel whose times differ between pads spills vector registers to the stack with unaligned
moves (see triforce.kernels.bf16_dot.opaque); the table shows microseconds per call, best of
`--repeats`."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import click
import numpy as np
import torch

KEYS, DIM = 512, 64


def _best(call, repeats: int) -> float:
    call()  # compiles or loads, and warms the caches
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(repeats):
            call()
        best = min(best, (time.perf_counter() - start) / repeats)
    return best * 1e6


def _kernels(rows: int):
    """(name, call) for each timed kernel, on fixed random inputs."""
    import numba

    from triforce.kernels import cpu_attention as ca
    from triforce.kernels.bf16_bits import bits_of
    from triforce.kernels.bf16_dot import bf16_rows, linear_bf16_pairs
    from triforce.kernels.bf16_scores import scores_bf16_pairs
    from triforce.kernels.bf16_values import values_bf16_pairs

    numba.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    bf16 = lambda *shape: bits_of(torch.randn(*shape, generator=g).to(torch.bfloat16))  # noqa: E731
    q, k, v = bf16(rows, DIM), bf16(KEYS, DIM), bf16(KEYS, DIM)
    scores = np.zeros((rows, KEYS), np.float32)
    scores_bf16_pairs(q, k, KEYS, np.float32(0.125), scores)
    probs = np.exp(scores - scores.max(axis=1, keepdims=True)).astype(np.float32)
    visible = np.full(rows, KEYS, np.int64)
    m, l, powers = np.zeros(rows, np.float32), np.zeros(rows, np.float32), np.zeros(KEYS, np.int32)
    work = scores.copy()
    acc, pad = np.zeros((rows, DIM), np.float32), np.zeros((2, DIM), np.uint16)
    pairs = np.zeros((rows, KEYS // 2), np.uint32)
    weight = bf16(576, 576)
    xs = {n: bf16_rows(torch.randn(n, 576, generator=g).to(torch.bfloat16).float().numpy()) for n in (1, 4)}
    outs = {n: np.zeros((n, 576), np.float32) for n in (1, 4)}
    heads, long_keys = 3, 8192
    qa, ka, va = bf16(heads, rows, DIM), bf16(heads, long_keys, DIM), bf16(heads, long_keys, DIM)
    out_a = np.zeros((heads, rows, DIM), np.uint16)

    def softmax():
        work[:] = scores
        ca._softmax(work, visible, m, l, powers)

    return [
        (f"scores {rows}x{KEYS}", lambda: scores_bf16_pairs(q, k, KEYS, np.float32(0.125), scores)),
        (f"softmax {rows}x{KEYS} (with a copy)", softmax),
        (f"values {rows}x{KEYS}", lambda: values_bf16_pairs(probs, v, KEYS, acc, pad, pairs)),
        ("linear 576x576, 1 row", lambda: linear_bf16_pairs(xs[1], weight, outs[1])),
        ("linear 576x576, 4 rows", lambda: linear_bf16_pairs(xs[4], weight, outs[4])),
        (f"attention {heads} heads x {rows} rows x {long_keys} keys",
         lambda: ca._attend(qa, ka, va, np.float32(0.125), long_keys, max(1, rows // 3), out_a, 1)),
    ]


def _child(rows: int, repeats: int) -> None:
    print(json.dumps({name: _best(call, max(1, repeats if "attention" not in name else repeats // 20))
                      for name, call in _kernels(rows)}))


@click.command()
@click.option("--pads", default="0,16,32,48", show_default=True, help="Bytes added to the environment, per child.")
@click.option("--rows", default=27, show_default=True, type=click.IntRange(3, 64),
              help="Query rows per KV head: 3 per new token on the default model (27: a verify of 9 tokens).")
@click.option("--repeats", default=200, show_default=True, type=click.IntRange(1, 100000))
@click.option("--child", is_flag=True, hidden=True)
def main(pads: str, rows: int, repeats: int, child: bool) -> None:
    from triforce.kernels.bf16_dot import HAS_BF16_DOT

    if child:
        return _child(rows, repeats)
    if not HAS_BF16_DOT:
        raise click.ClickException("this CPU (as numba targets it) has no AVX512-BF16: the kernels timed here do not run")
    setarch = shutil.which("setarch")
    runs = 1 if setarch else 3
    command = [sys.executable, "-m", "triforce.bench.stack_lottery", "--child", "--rows", str(rows), "--repeats", str(repeats)]
    results = {}
    for pad in (int(p) for p in pads.split(",")):
        for run in range(runs):
            env = dict(os.environ, TRIFORCE_STACK_PAD="x" * pad)
            prefix = [setarch, os.uname().machine, "-R"] if setarch else []
            done = subprocess.run(prefix + command, env=env, capture_output=True, text=True, check=True)
            results[f"pad {pad}" + (f" run {run + 1}" if runs > 1 else "")] = json.loads(done.stdout.splitlines()[-1])
    columns = list(results)
    print(f"us per call, best of {repeats}; " + ("ASLR off (setarch -R)" if setarch else "ASLR on, three runs per pad"))
    print("| kernel | " + " | ".join(columns) + " | slowest / fastest |")
    print("|---|" + "---:|" * (len(columns) + 1))
    for name in results[columns[0]]:
        times = [results[c][name] for c in columns]
        print(f"| {name} | " + " | ".join(f"{t:.1f}" for t in times) + f" | {max(times) / min(times):.2f} |")


if __name__ == "__main__":
    main()
