"""Does a kernel's speed depend on where the process's stack happens to start?

    python -m triforce.bench.stack_lottery [--pads 0,16,32,48] [--repeats 200] [--dtype float32]

Each kernel of `--dtype` (one attention job's scores, softmax and weighted values at `--rows`
query rows over 512 keys; the linear kernel at 1 and 4 rows on cache-resident weights; the whole
attention call: bfloat16 on the AVX512-BF16 kernels, float32 on the FMA ones of
triforce.kernels.cpu.f32_dot) is timed in child processes that differ only in the size of one environment variable,
which shifts the stack by that many bytes. Address-space randomisation is switched off for the
children (`setarch -R`, util-linux) so the shift is the only difference; where setarch is
missing each pad runs three times with randomisation and the spread shows the same lottery.
A kernel whose times differ between pads spills vector registers to the stack with unaligned
moves (see triforce.kernels.cpu.bf16_dot.opaque); the table shows microseconds per call, best of
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


def _inputs(rows: int, dtype: str):
    """Random queries, keys, values, a 576 x 576 weight and 1- and 4-row inputs, as the kernels
    of `dtype` take them (bfloat16 as raw bits)."""
    from triforce.kernels.cpu.bf16_bits import bits_of
    from triforce.kernels.cpu.bf16_dot import bf16_rows

    g = torch.Generator().manual_seed(0)
    if dtype == "bfloat16":
        make = lambda *shape: bits_of(torch.randn(*shape, generator=g).to(torch.bfloat16))  # noqa: E731
        rows_of = lambda x: bf16_rows(x.to(torch.bfloat16).float().numpy())  # noqa: E731
    else:
        make = lambda *shape: torch.randn(*shape, generator=g).numpy()  # noqa: E731
        rows_of = lambda x: x.numpy()  # noqa: E731
    xs = {n: rows_of(torch.randn(n, 576, generator=g)) for n in (1, 4)}
    return make, make(rows, DIM), make(KEYS, DIM), make(KEYS, DIM), make(576, 576), xs


def _kernels(rows: int, dtype: str):
    """(name, call) for each timed kernel of `dtype`, on fixed random inputs."""
    import numba

    from triforce.kernels.cpu import cpu_attention as ca
    from triforce.kernels.cpu.bf16_dot import linear_bf16_pairs
    from triforce.kernels.cpu.bf16_scores import scores_bf16_pairs
    from triforce.kernels.cpu.bf16_values import values_bf16_pairs
    from triforce.kernels.cpu.f32_attention_parts import scores_f32_fma, values_f32_fma
    from triforce.kernels.cpu.f32_dot import linear_f32_fma

    numba.set_num_threads(1)
    make, q, k, v, weight, xs = _inputs(rows, dtype)
    scores = np.zeros((rows, KEYS), np.float32)
    acc, pad = np.zeros((rows, DIM), np.float32), np.zeros((2, DIM), np.uint16)
    pairs = np.zeros((rows, KEYS // 2), np.uint32)
    if dtype == "bfloat16":
        score = lambda: scores_bf16_pairs(q, k, KEYS, np.float32(0.125), scores)  # noqa: E731
        weigh = lambda: values_bf16_pairs(probs, v, KEYS, acc, pad, pairs)  # noqa: E731
        linear = linear_bf16_pairs
    else:
        score = lambda: scores_f32_fma(q, k, KEYS, scores)  # noqa: E731
        weigh = lambda: values_f32_fma(probs, v, KEYS, acc)  # noqa: E731
        linear = linear_f32_fma
    score()
    probs = np.exp(scores - scores.max(axis=1, keepdims=True)).astype(np.float32)
    visible = np.full(rows, KEYS, np.int64)
    m, l = np.zeros(rows, np.float32), np.zeros(rows, np.float32)
    work = scores.copy()
    outs = {n: np.zeros((n, 576), np.float32) for n in (1, 4)}
    heads, long_keys = 3, 8192
    qa, ka, va = make(heads, rows, DIM), make(heads, long_keys, DIM), make(heads, long_keys, DIM)
    out_a = np.zeros_like(qa)
    attend = ca.attend_kernel(getattr(torch, dtype), DIM)

    def softmax():
        work[:] = scores
        ca._softmax(work, visible, m, l)

    return [
        (f"scores {rows}x{KEYS}", score),
        (f"softmax {rows}x{KEYS} (with a copy)", softmax),
        (f"values {rows}x{KEYS}", weigh),
        ("linear 576x576, 1 row", lambda: linear(xs[1], weight, outs[1])),
        ("linear 576x576, 4 rows", lambda: linear(xs[4], weight, outs[4])),
        (f"attention {heads} heads x {rows} rows x {long_keys} keys",
         lambda: attend(qa, ka, va, np.float32(0.125), long_keys, max(1, rows // 3), out_a, 1)),
    ]


def _child(rows: int, repeats: int, dtype: str) -> None:
    print(json.dumps({name: _best(call, max(1, repeats if "attention" not in name else repeats // 20))
                      for name, call in _kernels(rows, dtype)}))


@click.command()
@click.option("--pads", default="0,16,32,48", show_default=True, help="Bytes added to the environment, per child.")
@click.option("--rows", default=27, show_default=True, type=click.IntRange(3, 64),
              help="Query rows per KV head: 3 per new token on the default model (27: a verify of 9 tokens).")
@click.option("--repeats", default=200, show_default=True, type=click.IntRange(1, 100000))
@click.option("--dtype", type=click.Choice(["auto", "bfloat16", "float32"]), default="auto", show_default=True,
              help="Kernels to time: auto is bfloat16 on CPUs with AVX512-BF16, float32 on CPUs with FMA.")
@click.option("--child", is_flag=True, hidden=True)
def main(pads: str, rows: int, repeats: int, dtype: str, child: bool) -> None:
    from triforce.kernels.cpu.bf16_dot import HAS_BF16_DOT
    from triforce.kernels.cpu.f32_dot import HAS_F32_FMA

    if child:
        return _child(rows, repeats, dtype)
    if dtype == "auto":
        dtype = "bfloat16" if HAS_BF16_DOT else "float32"
    if dtype == "bfloat16" and not HAS_BF16_DOT:
        raise click.ClickException("this CPU (as numba targets it) has no AVX512-BF16: the bfloat16 kernels do not run")
    if dtype == "float32" and not HAS_F32_FMA:
        raise click.ClickException("this CPU (as numba targets it) has no FMA and AVX2: the float32 kernels do not run")
    setarch = shutil.which("setarch")
    runs = 1 if setarch else 3
    command = [sys.executable, "-m", "triforce.bench.stack_lottery", "--child", "--rows", str(rows), "--repeats", str(repeats), "--dtype", dtype]
    results = {}
    try:
        pad_bytes = [int(p) for p in pads.split(",")]
    except ValueError:
        raise click.BadParameter(f"{pads!r}: expected byte counts separated by commas, e.g. 0,16,32", param_hint="--pads")
    if any(p < 0 for p in pad_bytes):
        raise click.BadParameter("pads are byte counts, 0 or more", param_hint="--pads")
    for pad in pad_bytes:
        for run in range(runs):
            env = dict(os.environ, TRIFORCE_STACK_PAD="x" * pad)
            prefix = [setarch, os.uname().machine, "-R"] if setarch else []
            done = subprocess.run(prefix + command, env=env, capture_output=True, text=True, check=True)
            name = f"pad {pad}" + (f" run {run + 1}" if runs > 1 else "")
            name += f" ({sum(c == name or c.startswith(name + ' (') for c in results) + 1})" if name in results else ""
            results[name] = json.loads(done.stdout.splitlines()[-1])
    columns = list(results)
    print(f"{dtype} kernels, us per call, best of {repeats}; " + ("ASLR off (setarch -R)" if setarch else "ASLR on, three runs per pad"))
    print("| kernel | " + " | ".join(columns) + " | slowest / fastest |")
    print("|---|" + "---:|" * (len(columns) + 1))
    for name in results[columns[0]]:
        times = [results[c][name] for c in columns]
        print(f"| {name} | " + " | ".join(f"{t:.1f}" for t in times) + f" | {max(times) / min(times):.2f} |")


if __name__ == "__main__":
    main()
