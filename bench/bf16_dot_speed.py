"""The small-rows linear kernels on bfloat16 weights streamed from memory: widening to float32
against the AVX512-BF16 dot instruction, side by side in one run, with the machine's memory
bandwidth measured in the same run; then attention scores over 512 keys (one job of the
attention kernel) both ways.

    python -m triforce.bench.bf16_dot_speed [--layers 30] [--rows 1,4,9,16]

The weights are the default model's MLP and attention shapes per layer (gate/up 3072x576,
down 576x1536, q/k/v 960x576, o 576x576), `--layers` copies (more than the caches hold), run
in turn as a decoding step runs them; each kernel's best of `--repeats` passes is reported."""
from __future__ import annotations

import time

import click
import numpy as np
import torch

from triforce.bench.vs_llamacpp import memory_bandwidth
from triforce.kernels.bf16_bits import bits_of
from triforce.kernels.bf16_dot import HAS_BF16_DOT, bf16_rows, linear_bf16_pairs
from triforce.kernels.bf16_scores import scores_bf16_pairs
from triforce.kernels.cpu_attention import SPLIT, _scores
from triforce.kernels.cpu_linear import linear_widening

SHAPES = [(3072, 576), (576, 1536), (960, 576), (576, 576)]


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
        out = np.zeros((count, SPLIT), np.float32)
        widened = _best_pass(lambda x, k, o: _scores(x, k, SPLIT, o), [keys], [q.float().numpy()], repeats * 20)
        pairs = _best_pass(lambda x, k, o: scores_bf16_pairs(x, k, SPLIT, np.float32(1.0), o), [keys],
                           [bits_of(q)], repeats * 20)
        print(f"| {count} | {widened * 1e6:.1f} | {pairs * 1e6:.1f} | {widened / pairs:.2f}x |")


if __name__ == "__main__":
    main()
