"""How the Triton block kernels (triforce.kernels.cuda.quant_triton) are launched for one pass:
which kernel, which tiles, how many programs. Plain Python (no Triton) so the planning is tested
on any machine.

Two kernels:
  gemv: up to GEMV_ROWS rows of 16-bit activations (decoding and the drafting tiers): CUDA-core
      dot products of each row with the de-quantized tile, no tl.dot, whose 16-row tile spent
      15/16 of its work on padding at one row (q4_k ran 5.4-12.1x its bytes floor on the H200,
      bench/history/2026-11-28-gpu-campaign-h200-second.md);
  dot: every other pass (verify widths, prefill, and float32 activations at any width): tl.dot
      on tensor cores over de-quantized tiles.
A decoding step reads each weight once, so a pass of few rows is a stream of bytes: it needs
enough programs in flight to keep every SM loading. Where a matrix has too few tiles of rows,
the columns are split (SPLIT programs per tile, their float32 sums added after in a fixed order,
so results do not depend on timing): the planner aims at WAVES programs per SM, and stops
splitting at MIN_SPLIT_BLOCKS blocks a program (a matrix too small to split).

A row's result must not depend on its pass where the tests compare tokens (float32 greedy equals
ar on a card): float32 takes the dot kernel at every width, and a short pass's split depends on
the matrix alone, never on the rows (16-bit rows in a gemv pass and in a verify pass may differ
by rounding, as the attention kernels of those passes already do)."""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path

BLOCK = 32                # weights per quantized block
GEMV_ROWS = 4             # the most rows the gemv kernel takes (a power of two)
SHORT_M, TALL_M = 16, 64  # the dot kernel's rows per program: short passes, prefill
SHORT_PASS = 64           # up to this many rows the short tiles (and a rows-blind split) serve
WAVES = {"gemv": 4, "dot": 2}  # programs per SM the split aims at (at least 2: the class test)
MIN_SPLIT_BLOCKS = 8      # the fewest 32-weight blocks of a row one program walks
MAX_SPLIT = 32
NOMINAL_SMS = 132         # where the device cannot say (an H100/H200; a 4090 has 128)
# rows of the passes that compile every specialisation a run takes before its first token: the
# gemv kernel's row counts (1, 2 and 4 rows' tiles), the short and the tall dot tiles; Triton also
# specialises integer arguments equal to 1 or divisible by 16
WARM_ROWS = (1, 2, 3, 16, SHORT_PASS + 1, 2 * SHORT_PASS)


@dataclass(frozen=True)
class Tiles:
    block_n: int          # weight rows per program (dot: at least 16, tl.dot's width)
    step: int             # 32-weight blocks per step of the column loop
    warps: int = 4
    stages: int = 3       # software pipelining of the column loop
    split: int | None = None  # programs per tile along the columns; None: chosen by the shape

    @classmethod
    def parse(cls, text: str) -> "Tiles":
        """'BLOCK_N:STEP[:WARPS[:STAGES[:SPLIT]]]', SPLIT a number or 'auto' (by the shape)."""
        fields = text.split(":")
        try:
            split = None if len(fields) == 5 and fields[4] == "auto" else int(fields[4]) if len(fields) == 5 else None
            values = [int(v) for v in fields[:4]]
        except ValueError:
            values, split = [], None
        powers = values[:3]  # BLOCK_N, STEP and WARPS: Triton's shapes and warps are powers of two
        if (not 2 <= len(fields) <= 5 or not values or min(values) < 1 or (split is not None and split < 1)
                or values[0] < 4 or any(v & (v - 1) for v in powers)):
            raise ValueError(f"tiles '{text}': BLOCK_N:STEP:WARPS:STAGES:SPLIT, BLOCK_N a power of two >= 4 "
                             "(>= 16 for passes over 4 rows), STEP and WARPS powers of two, SPLIT a number or auto")
        return cls(*values, split=split)

    def __str__(self) -> str:
        return f"{self.block_n}:{self.step}:{self.warps}:{self.stages}:{self.split or 'auto'}"


DEFAULT_TILES = {"gemv": Tiles(16, 8, 4, 3), "dot": Tiles(32, 8, 4, 3)}
# tiles a card measured fastest per kernel, format and shape (`triforce bench kernels --tiles ...
# --write-table`), by compute capability ("8.9": a 4090, "9.0": an H100/H200); a shape or a card
# the table lacks takes DEFAULT_TILES
TILE_TABLE = Path(__file__).with_name("tile_table.json")


def table_key(kernel: str, kind: str, n: int, k: int) -> str:
    return f"{kernel} {kind} {n}x{k}"


@lru_cache(maxsize=None)
def measured_tiles(capability: str, path: Path = TILE_TABLE) -> dict[str, Tiles]:
    """The table's tiles for one compute capability ({} where the file or the card is absent)."""
    try:
        entries = json.loads(path.read_text()).get(capability, {})
    except FileNotFoundError:
        return {}
    return {key: Tiles.parse(text) for key, text in entries.items()}


@dataclass(frozen=True)
class Launch:
    kernel: str           # "gemv" or "dot"
    tiles: Tiles          # with its split decided
    block_m: int          # rows per program (gemv: all of the pass's rows, padded to a power of two)
    grid: tuple[int, int, int]

    @property
    def programs(self) -> int:
        return self.grid[0] * self.grid[1] * self.grid[2]

    def __str__(self) -> str:
        return f"{self.kernel} {self.tiles} x{self.block_m} rows, {self.programs} programs"


def measured_for(m: int, n: int, k: int, float32: bool, kind: str, table: dict[str, Tiles] | None) -> Tiles | None:
    """The table's tiles for a short pass of this shape (a prefill's tall tiles are not swept)."""
    if not table or m > SHORT_PASS:
        return None
    return table.get(table_key(kernel_for(m, float32), kind, n, k))


def kernel_for(m: int, float32: bool) -> str:
    return "gemv" if m <= GEMV_ROWS and not float32 else "dot"


def split_for(tiles_per_split: int, blocks: int, step: int, sms: int, waves: int) -> int:
    """Programs per tile along the columns: enough that tiles_per_split x split reaches waves
    programs per SM, each program still walking MIN_SPLIT_BLOCKS blocks (and whole steps)."""
    return max(1, min(most_split(blocks, step), -(-waves * sms // tiles_per_split)))


def most_split(blocks: int, step: int) -> int:
    """The most programs a row of `blocks` blocks splits into: whole steps of at least MIN_SPLIT_BLOCKS."""
    return max(1, min(MAX_SPLIT, -(-blocks // step), blocks // MIN_SPLIT_BLOCKS))


def plan(m: int, n: int, k: int, float32: bool, sms: int = NOMINAL_SMS, tiles: Tiles | None = None,
         kind: str = "", table: dict[str, Tiles] | None = None) -> Launch:
    """The launch of x [m, k] times a block matrix [n, k]^T of format `kind`: `tiles`, else the
    table's for a short pass (a prefill's tall tiles are not swept), else the defaults."""
    kernel = kernel_for(m, float32)
    tiles = tiles or measured_for(m, n, k, float32, kind, table) or DEFAULT_TILES[kernel]
    if kernel == "dot" and tiles.block_n < 16:
        raise ValueError(f"tiles {tiles}: a pass of {m} rows takes tl.dot, whose tiles are at least 16 rows")
    if kernel == "gemv":
        block_m = 1 << (m - 1).bit_length()
    else:
        block_m = SHORT_M if m <= SHORT_PASS else TALL_M
    m_tiles = -(-m // block_m)
    n_tiles = -(-n // tiles.block_n)
    if tiles.split is None:
        # a short pass splits as a pass of one tile of rows would: its rows' sums keep their order
        counted = n_tiles if m <= SHORT_PASS else m_tiles * n_tiles
        tiles = replace(tiles, split=split_for(counted, k // BLOCK, tiles.step, sms, WAVES[kernel]))
    split = min(tiles.split, -(-(k // BLOCK) // tiles.step))
    return Launch(kernel, replace(tiles, split=split), block_m, (m_tiles, n_tiles, split))


def too_small_to_split(launch: Launch, k: int) -> bool:
    """Whether the split stopped at its limit (the columns cannot feed more programs)."""
    return launch.tiles.split >= most_split(k // BLOCK, launch.tiles.step)


def split_sums_bytes(shapes, rows, sms: int = NOMINAL_SMS) -> int:
    """The largest float32 buffer of split sums (quant_triton.blocks_linear: split x rows x out)
    a pass of each of `rows` rows makes over these [out, in] matrices, 16-bit or float32: the
    block kernels' scratch, which the memory plan holds."""
    return max((launch.tiles.split * m * n * 4 for n, k in shapes for m in rows for f32 in (False, True)
                if (launch := plan(m, n, k, f32, sms)).tiles.split > 1), default=0)
