"""Block kernels against the float matmul and the bytes floor, at a model's projection shapes.

For each projection of one decoder layer of `--arch` (q/k/v stacked, o, gate/up stacked, down)
and each pass size in `--rows` (1: a decoding step; 16: a verify pass), times
  float:  the projection in --dtype (F.linear on a GPU; the small-rows kernel on a CPU),
  BLOCKS: each format in --formats (the Triton kernels on a GPU, the numba kernels on a CPU),
and reports ms, the weight bytes each reads, the GB/s that makes and the ratio to the floor
(weight bytes over the device memory bandwidth measured in the same run by a large copy).
Weights are random (blocks: random quants and scales); copies of each matrix are cycled so a
repeat does not find the previous one in the cache (on a GPU enough to fill its L2 three times).
On a GPU the calls are captured in a CUDA graph and its replays timed by events: a call timed
on its own from the host (as the H200 campaign of 2026-11-28 did) adds Python's dispatch, the
launch and a sync, tens of microseconds against a projection's few; on a CPU each call is timed.

    triforce bench kernels --arch llama2-7b-128k --rows 1,16 --json
    triforce bench kernels --formats q4_k --tiles 16:8:4:3:auto,32:8:4:3:4 --write-table T.json  # a GPU's sweep

`--lanes 8,16` times a CPU's block kernels at each vector width given (16: AVX-512 hosts only), a row
each: `triforce bench kernels --arch smollm2-135m --rows 1 --formats q4_0,q4_1,q8_0 --lanes 8,16`.

`--tiles` times the Triton kernels (a GPU's) at each BLOCK_N:STEP:WARPS:STAGES:SPLIT given
(triforce.kernels.cuda.quant_launch.Tiles) instead of the shipped ones, a row each.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import click
import torch
import torch.nn.functional as F

from triforce.bench.harness import GRAPHED_CALLS, each_call, emit, graphed_ms, output_option
from triforce.model.architectures import arch_hf_config
from triforce.config.model import ModelConfig
from triforce.model.loading import resolve_device, resolve_dtype
from triforce.plan.measure import memory_gbps

COPIES = 3


def copies_for(nbytes: int, device: torch.device) -> int:
    """Copies of a matrix to cycle: COPIES, or on a GPU enough to hold three times its L2."""
    if device.type != "cuda":
        return COPIES
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 << 20)
    return max(COPIES, -(-3 * l2 // nbytes))


def shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """[out, in] of one layer's fused projections."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return {"qkv": (q + 2 * kv, cfg.hidden_size), "o": (cfg.hidden_size, q),
            "gate_up": (2 * cfg.intermediate_size, cfg.hidden_size), "down": (cfg.hidden_size, cfg.intermediate_size)}


def layers_for(kind: str, rows: int, cols: int, dtype: torch.dtype, device: torch.device, seed: int, tiles=None,
               lanes: int | None = None):
    """Linears of one shape (copies_for of them): callables x -> x W^T, and the bytes one reads.
    tiles: the Triton kernels' (blocks on a GPU) instead of the shipped ones; lanes: the CPU block
    kernels' vector width instead of the host's."""
    g = torch.Generator(device=device).manual_seed(seed)
    if kind == "float":
        from triforce.kernels.cpu.linear.dense import FusedLinear
        copies = copies_for(rows * cols * dtype.itemsize, device)
        weights = [torch.empty(rows, cols, dtype=dtype, device=device).normal_(0, 0.02, generator=g)
                   for _ in range(copies)]
        if device.type == "cuda":
            return [lambda x, w=w: F.linear(x, w) for w in weights], weights[0].numel() * weights[0].element_size()
        return [FusedLinear(w) for w in weights], weights[0].numel() * weights[0].element_size()
    from triforce.model.quantized import random_block
    from triforce.model.quantized_layers import block_linear
    first = random_block(kind, rows, cols, device, g)
    blocks = [first, *(random_block(kind, rows, cols, device, g) for _ in range(copies_for(first.nbytes, device) - 1))]
    if tiles is not None:
        from triforce.kernels.cuda.quant_triton import blocks_linear
        return [lambda x, b=b: blocks_linear(x, b, tiles=tiles) for b in blocks], blocks[0].nbytes
    linears = [block_linear(b) for b in blocks]
    if lanes is not None:
        for linear in linears:
            linear.lanes = lanes
    return linears, blocks[0].nbytes


def lane_widths(text: str | None, device: torch.device) -> list[int | None]:
    """--lanes as a list (None: the host's width)."""
    if not text:
        return [None]
    from triforce.kernels.cpu.linear.block_dot import WIDE_BLOCKS
    from triforce.kernels.cpu.simd.f32_dot import HAS_F32_FMA

    widths = []
    for part in (p.strip() for p in text.split(",")):
        if part not in ("8", "16"):
            raise click.BadParameter(f"'{part}' is not a vector width: 8 or 16", param_hint="--lanes")
        widths.append(int(part))
    if device.type == "cuda":
        raise click.UsageError("--lanes sets the CPU block kernels' vector width: a CPU's")
    if not HAS_F32_FMA or (16 in widths and not WIDE_BLOCKS):
        raise click.UsageError(f"this CPU runs no {'16-lane' if HAS_F32_FMA else 'vector'} block kernels "
                               f"({'AVX-512' if HAS_F32_FMA else 'FMA and AVX2'} missing)")
    return widths


def launch_of(kind: str, m: int, n: int, k: int, dtype: torch.dtype, device: torch.device, tiles) -> dict:
    """The Triton kernel, tiles and programs a GPU's block pass ran (quant_launch's plan)."""
    if kind == "float" or device.type != "cuda":
        return {}
    from triforce.kernels.cuda.quant_launch import measured_tiles, plan
    from triforce.kernels.cuda.quant_triton import capability, device_sms
    launch = plan(m, n, k, dtype == torch.float32, device_sms(device), tiles, kind, measured_tiles(capability(device)))
    return {"launch": str(launch), "kernel": launch.kernel, "launch_tiles": str(launch.tiles)}


def fastest_tiles(rows: list[dict]) -> dict[str, str]:
    """The tile table's entries a sweep measured: per kernel, format and shape, the fastest tiles."""
    from triforce.kernels.cuda.quant_launch import table_key

    best: dict[str, dict] = {}
    for r in rows:
        if "tiles" in r and "kernel" in r:
            key = table_key(r["kernel"], r["weights"], *r["shape"])
            if key not in best or r["ms"] < best[key]["ms"]:
                best[key] = r
    return {key: r["launch_tiles"] for key, r in sorted(best.items())}


def write_table(path: Path, capability: str, entries: dict[str, str]) -> None:
    """Merge a card's entries into the tile table at `path` (other cards' kept)."""
    table = json.loads(path.read_text()) if path.is_file() else {}
    table.setdefault(capability, {}).update(entries)
    temporary = path.with_name(f".{path.name}.partial")
    temporary.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    temporary.replace(path)


@click.command()
@click.option("--arch", default="llama2-7b-128k", show_default=True)
@click.option("--rows", "row_counts", default="1,16", show_default=True, help="Input rows per pass.")
@click.option("--formats", default="q4_k,q8_0", show_default=True)
@click.option("--dtype", default="auto", show_default=True, help="Activations (and the float weights).")
@click.option("--device", default="auto", show_default=True)
@click.option("--repeats", type=int, default=30, show_default=True)
@click.option("--tiles", "tile_list", default=None,
              help="Comma-separated BLOCK_N:STEP:WARPS:STAGES:SPLIT of the Triton kernels to time (a GPU's).")
@click.option("--write-table", "table_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="With --tiles: merge the fastest tiles per kernel, format and shape into this tile table "
                   "(kernels/cuda/tile_table.json is the one the runtime reads) under this card's capability.")
@click.option("--lanes", "lane_list", default=None,
              help="Comma-separated vector widths of a CPU's block kernels to time (8, 16: AVX-512 only); "
                   "default: the host's.")
@output_option
def main(arch, row_counts, formats, dtype, device, repeats, tile_list, table_path, lane_list, fmt):
    """Block-weight kernels against the float matmul and the bytes floor, at a model's projection shapes."""
    device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, device)
    sweep = [None]
    if tile_list:
        if device.type != "cuda":
            raise click.UsageError("--tiles sets the Triton kernels' tiles: a GPU's (on a CPU the numba kernels run)")
        from triforce.kernels.cuda.quant_launch import Tiles
        try:
            sweep = [Tiles.parse(text.strip()) for text in tile_list.split(",")]
        except ValueError as e:
            raise click.BadParameter(str(e), param_hint="--tiles") from None
    if table_path is not None and not tile_list:
        raise click.UsageError("--write-table takes the fastest of a sweep: give --tiles")
    cfg = ModelConfig.from_hf(arch_hf_config(arch))
    gbps = memory_gbps(device)
    kinds = ["float", *(f.strip() for f in formats.split(",") if f.strip())]
    rows_out = []
    widths = lane_widths(lane_list, device)
    runs = [(kind, tiles, lanes) for kind in kinds for tiles in (sweep if kind != "float" else [None])
            for lanes in (widths if kind != "float" else [None])]
    for name, (n, k) in shapes(cfg).items():
        for kind, tiles, lanes in runs:
            print(f"{name} [{n} x {k}] {kind}{f' tiles {tiles}' if tiles else ''}{f' {lanes} lanes' if lanes else ''} ...",
                  file=sys.stderr)
            linears, nbytes = layers_for(kind, n, k, torch_dtype, device, seed=len(rows_out), tiles=tiles, lanes=lanes)
            for m in (int(r) for r in row_counts.split(",")):
                xs = [torch.randn(m, k, dtype=torch_dtype, device=device) for _ in range(len(linears))]
                turn = iter(range(1 << 30))

                def call():
                    i = next(turn) % len(linears)
                    return linears[i](xs[i])

                timing = graphed_ms(call, repeats) if device.type == "cuda" else each_call(call, device, repeats)
                ms = timing.median_ms
                floor_ms = nbytes / (gbps * 1e9) * 1e3
                rows_out.append({"matrix": name, "shape": [n, k], "weights": kind, "rows": m, "ms": round(ms, 4),
                                 **({"tiles": str(tiles)} if tiles else {}), **({"lanes": lanes} if lanes else {}),
                                 **launch_of(kind, m, n, k, torch_dtype,
                                                                                        device, tiles),
                                 "weight_bytes": nbytes, "gbps": round(nbytes / ms / 1e6, 1),
                                 "x_floor": round(ms / floor_ms, 2), "spread": round(timing.spread, 3)})
    out = {"arch": arch, "device": str(device), "dtype": str(torch_dtype).removeprefix("torch."),
           "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "memory_gbps_measured": round(gbps, 1), "repeats": repeats,
           "timing": f"CUDA graph of {GRAPHED_CALLS} calls, replays timed by events" if device.type == "cuda"
           else "each call on the host's clock"}
    if table_path is not None:
        from triforce.kernels.cuda.quant_triton import capability
        out["tile_table"] = {"path": str(table_path), "capability": capability(device),
                             "entries": fastest_tiles(rows_out)}
        write_table(table_path, out["tile_table"]["capability"], out["tile_table"]["entries"])
    emit(fmt, out, rows_out, lambda: table(out, rows_out))


def table(out: dict, rows_out: list[dict]) -> None:
    print(f"{out['arch']} projections, activations {out['dtype']} on {out['device_name']}; "
          f"device memory bandwidth measured now: {out['memory_gbps_measured']} GB/s")
    print(f"{'matrix':8s} {'weights':8s} {'rows':>4s} {'ms':>9s} {'MB read':>8s} {'GB/s':>7s} {'x floor':>8s} {'spread':>7s}")
    for r in rows_out:
        weights = r['weights'] + (' ' + r['tiles'] if 'tiles' in r else '') + (f" x{r['lanes']}" if 'lanes' in r else '')
        print(f"{r['matrix']:8s} {weights:8s} {r['rows']:4d} {r['ms']:9.4f} {r['weight_bytes'] / 1e6:8.1f} "
              f"{r['gbps']:7.1f} {r['x_floor']:8.2f} {r['spread']:7.3f}")
    if "tile_table" in out:
        t = out["tile_table"]
        print(f"fastest tiles for capability {t['capability']}, merged into {t['path']}:")
        for key, tiles in t["entries"].items():
            print(f"  {key}: {tiles}")


if __name__ == "__main__":
    main()
