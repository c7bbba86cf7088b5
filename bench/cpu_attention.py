"""Decoding and verify attention on the CPU: our kernel (triforce.kernels.cpu.attention.decode)
against the SDPA path it replaces, by query rows and keys, on a model's head shapes.

    triforce bench attention --model default --keys 2048,8192,26000 --rows 1,2,4,8,16

Each cell is the median of separately timed calls over k, v laid out as a cache buffer's first
`keys` rows (as the engine calls it). `routed` says which one the engine takes for that call
(kernels.attention): our kernel keeps every verify of up to SMALL_QUERIES rows computing each
row as a one-row step would (bfloat16 greedy speculation equals AR), whatever SDPA costs."""
from __future__ import annotations

import click
import torch

from triforce.bench.harness import each_call, emit, output_option


def head_shapes(model: str | None, heads: int, kv_heads: int, head_dim: int) -> tuple[int, int, int, str]:
    if model is None:
        return heads, kv_heads, head_dim, f"{heads} heads, {kv_heads} KV heads, dim {head_dim}"
    from triforce.model.loading import model_shape

    config, _ = model_shape(model)
    return config.num_heads, config.num_kv_heads, config.head_dim, \
        f"{model}: {config.num_heads} heads, {config.num_kv_heads} KV heads, dim {config.head_dim}"


def time_cell(heads: int, kv_heads: int, dim: int, rows: int, keys: int, dtype, repeats: int) -> dict:
    from triforce.kernels.attention import attention
    from triforce.kernels.cpu.attention import decode

    g = torch.Generator().manual_seed(keys * 31 + rows)
    capacity = keys + 256  # a cache buffer with room to grow: its first `keys` rows are the view
    k_buf, v_buf = (torch.randn(1, kv_heads, capacity, dim, generator=g).to(dtype) for _ in range(2))
    k, v = k_buf[:, :, :keys], v_buf[:, :, :keys]
    q = torch.randn(1, heads, rows, dim, generator=g).to(dtype)
    scale = dim ** -0.5
    ours = each_call(lambda: decode.attention(q, k, v, scale=scale), "cpu", repeats)
    sdpa = each_call(lambda: attention(q, k, v, scale=scale, cpu_kernel=False), "cpu", repeats)
    return {"rows": rows, "keys": keys, "ours_ms": round(ours.median_ms, 3), "sdpa_ms": round(sdpa.median_ms, 3),
            "no_tiles_ms": _without_tiles(decode, q, k, v, scale, repeats),
            "ours_over_sdpa": round(sdpa.median_ms / ours.median_ms, 2),
            "routed": "ours" if decode.takes(q, k, v, None) else "sdpa"}


def _without_tiles(decode, q, k, v, scale: float, repeats: int) -> float | None:
    """Where our kernel runs on AMX tiles, its median on the path this CPU had before them
    (AVX512-BF16 dots), timed beside it; None elsewhere."""
    if decode.attend_kernel(q.dtype, q.shape[-1]) is not decode._attend_amx:
        return None
    decode.HAS_AMX = False
    try:
        return round(each_call(lambda: decode.attention(q, k, v, scale=scale), "cpu", repeats).median_ms, 3)
    finally:
        decode.HAS_AMX = True


def _ints(text: str, what: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise click.BadParameter(f"{what} must be comma-separated whole numbers, got '{text}'") from None
    if not values or min(values) < 1:
        raise click.BadParameter(f"{what} must be at least 1, got '{text}'")
    return values


@click.command()
@click.option("--model", default="default", show_default=True,
              help="Take the head shapes of this model ('none': --heads, --kv-heads, --head-dim).")
@click.option("--heads", type=int, default=9, show_default=True)
@click.option("--kv-heads", type=int, default=3, show_default=True)
@click.option("--head-dim", type=int, default=64, show_default=True)
@click.option("--keys", default="2048,8192,26000", show_default=True, help="Comma-separated context lengths.")
@click.option("--rows", default="1,2,4,8,16", show_default=True,
              help="Comma-separated new tokens per call (1: decoding; a verify: gamma + 1).")
@click.option("--dtype", type=click.Choice(["bfloat16", "float32"]), default="bfloat16", show_default=True)
@click.option("--repeats", type=click.IntRange(min=3), default=15, show_default=True)
@output_option
def main(model, heads, kv_heads, head_dim, keys, rows, dtype, repeats, fmt):
    """Decoding and verify attention on this CPU: our kernel against SDPA by rows and keys."""
    from triforce.bench.harness import provenance
    from triforce.kernels.cpu.simd.features import host_flags

    key_list, row_list = _ints(keys, "--keys"), _ints(rows, "--rows")
    heads, kv_heads, head_dim, shapes = head_shapes(None if model == "none" else model, heads, kv_heads, head_dim)
    if heads % kv_heads:
        raise click.BadParameter(f"--heads ({heads}) must be a multiple of --kv-heads ({kv_heads})")
    torch_dtype = getattr(torch, dtype)
    cells = []
    for n in key_list:
        for r in row_list:
            cells.append(time_cell(heads, kv_heads, head_dim, r, n, torch_dtype, repeats))
            click.echo(f"  {n} keys, {r} rows: ours {cells[-1]['ours_ms']} ms, sdpa {cells[-1]['sdpa_ms']} ms",
                       err=True)
    flags = host_flags()
    summary = {"shapes": shapes, "dtype": dtype, "threads": torch.get_num_threads(),
               "amx_bf16": "amx_bf16" in flags, "avx512_bf16": "avx512_bf16" in flags, "rows": cells,
               "provenance": provenance()}

    def table():
        click.echo(f"attention on this CPU ({shapes}, {dtype}, {summary['threads']} threads, "
                   f"AMX {'yes' if summary['amx_bf16'] else 'no'}, AVX512-BF16 "
                   f"{'yes' if summary['avx512_bf16'] else 'no'}): median ms per call")
        click.echo("| keys | rows | ours ms | without AMX tiles ms | SDPA ms | ours x faster | routed |\n"
                   "|---:|---:|---:|---:|---:|---:|---|")
        for c in cells:
            click.echo(f"| {c['keys']} | {c['rows']} | {c['ours_ms']} | {c['no_tiles_ms'] or '-'} | {c['sdpa_ms']} | "
                       f"{c['ours_over_sdpa']} | {c['routed']} |")

    emit(fmt, summary, cells, table)


if __name__ == "__main__":
    main()
