"""The small-rows linear kernels on bfloat16 weights streamed from memory: widening to float32
against the AVX512-BF16 dot instruction, side by side in one run, with the machine's memory
bandwidth measured in the same run; then attention scores over 512 keys (one job of the
attention kernel) both ways. First it prints the instruction's own peak here: 12 independent
accumulators on register-resident operands, one thread and all threads (the ceiling any of
these kernels could reach; AMD Zen 4 retires about one 512-bit vdpbf16ps per cycle per core).

    python -m triforce.bench.bf16_dot_speed [--layers 30] [--rows 1,4,9,16]

The weights are the default model's MLP and attention shapes per layer (gate/up 3072x576,
down 576x1536, q/k/v 960x576, o 576x576), `--layers` copies (more than the caches hold), run
in turn as a decoding step runs them; each kernel's best of `--repeats` passes is reported."""
from __future__ import annotations

import time

import click
import numba
import numpy as np
import torch
from numba import prange

from triforce.bench.vs_llamacpp import memory_bandwidth
from triforce.kernels.cpu.attention_paths import scores_widened
from triforce.kernels.cpu.bf16_bits import bits_of
from triforce.kernels.cpu.bf16_dot import HAS_BF16_DOT, _sum_lanes, bf16_rows, dot_step, linear_bf16_pairs, zeros
from triforce.kernels.cpu.bf16_scores import scores_bf16_pairs
from triforce.kernels.cpu.cpu_attention import SPLIT
from triforce.kernels.cpu.cpu_linear import linear_widening

SHAPES = [(3072, 576), (576, 1536), (960, 576), (576, 576)]


@numba.njit(parallel=True, cache=True)
def _peak(w, iters, out):
    """iters x 12 vdpbf16ps per thread, 12 independent chains (the latency hidden)."""
    for job in prange(out.shape[0]):
        a0, a1, a2, a3, a4, a5 = zeros(), zeros(), zeros(), zeros(), zeros(), zeros()
        b0, b1, b2, b3, b4, b5 = zeros(), zeros(), zeros(), zeros(), zeros(), zeros()
        for _ in range(iters):
            a0, a1, a2 = dot_step(a0, w, w, 0), dot_step(a1, w, w, 32), dot_step(a2, w, w, 64)
            a3, a4, a5 = dot_step(a3, w, w, 96), dot_step(a4, w, w, 128), dot_step(a5, w, w, 160)
            b0, b1, b2 = dot_step(b0, w, w, 192), dot_step(b1, w, w, 224), dot_step(b2, w, w, 256)
            b3, b4, b5 = dot_step(b3, w, w, 288), dot_step(b4, w, w, 320), dot_step(b5, w, w, 352)
        out[job] = (_sum_lanes(a0, a1) + _sum_lanes(a2, a3) + _sum_lanes(a4, a5) + _sum_lanes(b0, b1)
                    + _sum_lanes(b2, b3) + _sum_lanes(b4, b5))


def instruction_peak(threads: int, iters: int = 20_000_000) -> float:
    """vdpbf16ps per second over `threads` threads (each 64 floating-point operations)."""
    w = np.full(384, 0x3F80, np.uint16)  # 1.0: the sums stay finite
    out = np.zeros(threads, np.float32)
    previous = numba.get_num_threads()
    numba.set_num_threads(threads)
    try:
        _peak(w, 10, out)
        start = time.perf_counter()
        _peak(w, iters, out)
        return 12 * iters * threads / (time.perf_counter() - start)
    finally:
        numba.set_num_threads(previous)


def _best_pass(kernel, weights, inputs, repeats: int) -> float:
    outs = [np.zeros((x.shape[0], w.shape[0]), np.float32) for w, x in zip(weights, inputs)]
    best = float("inf")
    for _ in range(repeats + 1):  # the first pass compiles (or loads) and warms
        start = time.perf_counter()
        for w, x, out in zip(weights, inputs, outs):
            kernel(x, w, out)
        best = min(best, time.perf_counter() - start)
    return best


@click.command()
@click.option("--layers", default=30, show_default=True, type=click.IntRange(1, 200))
@click.option("--rows", default="1,4,9,16", show_default=True, help="Input rows per product (tokens of a pass).")
@click.option("--repeats", default=10, show_default=True, type=click.IntRange(1, 1000))
def main(layers: int, rows: str, repeats: int) -> None:
    if not HAS_BF16_DOT:
        raise click.ClickException("this CPU (as numba targets it) has no AVX512-BF16: nothing to compare")
    for threads in sorted({1, numba.config.NUMBA_NUM_THREADS}):
        rate = instruction_peak(threads)
        print(f"vdpbf16ps peak, {threads} thread(s): {rate / 1e9:.2f} G/s = {rate * 64 / 1e9:.0f} GFLOP/s")
    g = torch.Generator().manual_seed(0)
    weights = [bits_of(torch.randn(n, k, generator=g).to(torch.bfloat16)) for _ in range(layers) for n, k in SHAPES]
    total = sum(w.nbytes for w in weights)
    print(f"{total / 1e6:.0f} MB of bfloat16 weights; memory bandwidth (512 MB sum): "
          f"{memory_bandwidth() / 1e9:.1f} GB/s")
    print("| rows | widening ms | GB/s | bf16 dot ms | GB/s | speed-up |\n|---:|---:|---:|---:|---:|---:|")
    for count in (int(r) for r in rows.split(",")):
        xs = [torch.randn(count, w.shape[1], generator=g).to(torch.bfloat16).float().numpy() for w in weights]
        widened = _best_pass(linear_widening, weights, xs, repeats)
        pairs = _best_pass(linear_bf16_pairs, weights, [bf16_rows(x) for x in xs], repeats)
        print(f"| {count} | {widened * 1e3:.2f} | {total / widened / 1e9:.1f} | {pairs * 1e3:.2f} | "
              f"{total / pairs / 1e9:.1f} | {widened / pairs:.2f}x |")
    print(f"\nscores of {SPLIT} keys (head dim 64)\n| query rows | widening us | bf16 dot us | speed-up |\n|---:|---:|---:|---:|")
    keys = bits_of(torch.randn(SPLIT, 64, generator=g).to(torch.bfloat16))
    for count in (3, 9, 27):  # a KV head's rows for 1, 3 and 9 tokens (three query heads per KV head)
        q = torch.randn(count, 64, generator=g).to(torch.bfloat16)
        widened = _best_pass(lambda x, k, o: scores_widened(x, k, SPLIT, o), [keys], [q.float().numpy()], repeats * 20)
        pairs = _best_pass(lambda x, k, o: scores_bf16_pairs(x, k, SPLIT, np.float32(1.0), o), [keys],
                           [bits_of(q)], repeats * 20)
        print(f"| {count} | {widened * 1e6:.1f} | {pairs * 1e6:.1f} | {widened / pairs:.2f}x |")


if __name__ == "__main__":
    main()
