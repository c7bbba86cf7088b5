"""Intel AMX tiles from numba: eight 1 KB tile registers and `tdpbf16ps`, a 16 x 16 block of
float32 sums of bfloat16 pair products per instruction (16 rows x 32 values times 32 values x
16 columns), for the attention's verify passes (triforce.kernels.cpu.attention.amx_parts).

Why: a verify pass multiplies 15-27 query rows per KV head against every key; on this
project's AMX Xeon the AVX512-BF16 paths did that at 40-50 GFLOP/s (bench/RESULTS.md, "AMX
attention"), one 16-lane instruction at a time, where one tile instruction does 256 lanes' work.

A kernel sets each tile's shape once per call (`tile_config`: at most TILE_ROWS rows of
TILE_BYTES bytes, 16 float32 or 32 bfloat16), loads it per job (`configure`) and drops it after
(`release`, so the thread saves no tile state on a context switch). Tile numbers are literals
(LLVM's immediate-tile intrinsics). A row of a product depends only on that row of the left
operand: a query row's scores have the same bits whatever other rows share its tile.

Linux lends a process the tile registers only once asked (arch_prctl ARCH_REQ_XCOMP_PERM, since
5.16); `HAS_AMX` is true only where numba compiles for this CPU, the CPU has AMX-BF16 and the ask
succeeded, and nothing here is compiled elsewhere."""
from __future__ import annotations

import ctypes

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from triforce.kernels.cpu.simd.features import kernels_may_use

TILE_ROWS, TILE_BYTES = 16, 64
_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA = 158, 0x1023, 18
_I8, _I64 = ir.IntType(8), ir.IntType(64)
_BYTES = _I8.as_pointer()


def _granted() -> bool:
    """Ask Linux for the tile registers (idempotent; process-wide)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) == 0
    except (OSError, AttributeError):
        return False


HAS_AMX = kernels_may_use("amx_tile", "amx_bf16", "avx512_bf16") and _granted()


@numba.njit(cache=True)
def tile_config(shapes):
    """The 64-byte configuration `configure` loads: palette 1, tile t `shapes[t, 0]` rows of
    `shapes[t, 1]` bytes (shapes int64 [8, 2]; rows 0: the tile unused)."""
    config = np.zeros(64, np.uint8)
    config[0] = 1
    for tile in range(8):
        config[16 + 2 * tile] = shapes[tile, 1] & 255
        config[17 + 2 * tile] = shapes[tile, 1] >> 8
        config[48 + tile] = shapes[tile, 0]
    return config


def _call(builder, name, argument_types, arguments):
    function = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), argument_types), name)
    builder.call(function, arguments)


def _at(context, builder, array_type, array, offset):
    """The address of element `offset` of a C-contiguous array's data, as bytes."""
    data = context.make_array(array_type)(context, builder, array).data
    return builder.bitcast(builder.gep(data, [offset]), _BYTES)


def _literal(*values) -> bool:
    return all(isinstance(value, types.IntegerLiteral) for value in values)


def _tile(value):
    return ir.Constant(_I8, value.literal_value)


@intrinsic
def configure(typingctx, config):
    """Load tile_config()'s bytes into this thread's tile configuration."""
    def codegen(context, builder, signature, args):
        _call(builder, "llvm.x86.ldtilecfg", [_BYTES], [_at(context, builder, signature.args[0], args[0],
                                                             ir.Constant(_I64, 0))])
        return context.get_dummy_value()

    return types.none(config), codegen


@intrinsic
def release(typingctx):
    def codegen(context, builder, signature, args):
        _call(builder, "llvm.x86.tilerelease", [], [])
        return context.get_dummy_value()

    return types.none(), codegen


@intrinsic
def zero(typingctx, tile):
    if not _literal(tile):
        return None

    def codegen(context, builder, signature, args):
        _call(builder, "llvm.x86.tilezero", [_I8], [_tile(tile)])
        return context.get_dummy_value()

    return types.none(tile), codegen


def _mover(instruction: str, what: str):
    """An intrinsic (tile, array, offset, stride) running `instruction` between tile `tile` and
    TILE_ROWS rows of `array` from element `offset` (C-contiguous data), rows `stride` bytes apart."""
    @intrinsic
    def move(typingctx, tile, array, offset, stride):
        if not _literal(tile):
            return None

        def codegen(context, builder, signature, args):
            _call(builder, instruction, [_I8, _BYTES, _I64],
                  [_tile(tile), _at(context, builder, signature.args[1], args[1], args[2]), args[3]])
            return context.get_dummy_value()

        return types.none(tile, array, types.intp, types.intp), codegen

    move.__doc__ = what
    return move


load = _mover("llvm.x86.tileloadd64", "Tile `tile` = rows of `array` from element `offset`, `stride` bytes apart.")
store = _mover("llvm.x86.tilestored64", "`load`'s converse: tile `tile`'s rows into `array`.")


@intrinsic
def dot(typingctx, sums, rows, pairs):
    """Tile `sums` (float32) += tile `rows` (bfloat16 rows of 32 values) times tile `pairs`
    (row p: pair p of each of 16 columns, its two values side by side)."""
    if not _literal(sums, rows, pairs):
        return None

    def codegen(context, builder, signature, args):
        _call(builder, "llvm.x86.tdpbf16ps", [_I8] * 3, [_tile(sums), _tile(rows), _tile(pairs)])
        return context.get_dummy_value()

    return types.none(sums, rows, pairs), codegen
