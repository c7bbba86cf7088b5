"""bfloat16 dot products by the CPU's bfloat16 dot-product instruction (AVX512-BF16's
`vdpbf16ps`: 32 products of bfloat16 pairs summed into 16 float32 lanes per instruction), for
the linear kernels (triforce.kernels.cpu.linear.dense) and the attention's bfloat16 paths.

Why: widening bfloat16 weights to float32 (a zero-extend and a shift per 16 values) and then
multiplying in float32 makes a decoding step's bfloat16 products compute-bound on this project's
2-core box (~20 GB/s of weights where memory gives ~34); the instruction takes the bits as they
are, half the loads and none of the widening. Measured there (AMD Zen 4): weights streamed from
memory 1.1-1.4x faster for one row, 1.3-1.9x for four to sixteen rows, two runs on a noisy machine
(bench/history/2026-11-23-24-cpu-vs-llamacpp-avx512.md).

Numba has no vector types: `F32x16` below is one (an LLVM <16 x float> held in registers), and
the intrinsics load 32 bfloat16 values as the instruction's operand. A row's dot product always
runs the same instruction sequence (two accumulators over alternate 32-value blocks, one fixed
tree to sum the lanes), whether it is computed alone or with three other rows sharing the
weight loads, so a token's result does not depend on the other tokens of its pass. Products of
bfloat16 values are exact in float32; the instruction flushes subnormals to zero (values below
1e-38, which activations and weights of the models served here do not reach).

The instruction exists only where the CPU has it: `HAS_BF16_DOT` says whether numba compiles for
such a CPU, and nothing here is compiled elsewhere (the caller keeps its widening kernel)."""
from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, models, register_model

from triforce.kernels.cpu.simd.bf16_bits import narrow
from triforce.kernels.cpu.simd.features import kernels_may_use
from triforce.kernels.cpu.simd.lanes import lane_tree

PAIR_BLOCK = 64  # values per step of a dot (two accumulators x 32): widths must be a multiple


HAS_BF16_DOT = kernels_may_use("avx512_bf16")


class _BFloat(ir.Type):
    """LLVM's `bfloat` (llvmlite has no class for it; its IR is text, so the name suffices)."""

    def _to_string(self):
        return "bfloat"

    def __eq__(self, other):
        return isinstance(other, _BFloat)

    def __hash__(self):
        return hash("bfloat")


LANES = ir.VectorType(ir.FloatType(), 16)
OPERAND = ir.VectorType(_BFloat(), 32)
_LOADED = ir.VectorType(ir.IntType(32), 16)  # the 64 bytes as loaded, cast to OPERAND


class F32x16(types.Type):
    """16 float32 lanes in one register: a dot product's accumulator."""

    def __init__(self):
        super().__init__(name="F32x16")


f32x16 = F32x16()


@register_model(F32x16)
class _F32x16Model(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, LANES)


@intrinsic
def zeros(typingctx):
    return f32x16(), lambda context, builder, signature, args: ir.Constant(LANES, None)


def operand_at(builder, pointer):
    """The 32 bfloat16 values at `pointer` (an element pointer), as the instruction's operand."""
    return builder.bitcast(builder.load(builder.bitcast(pointer, _LOADED.as_pointer()), align=2), OPERAND)


def opaque(builder, pointer):
    """`pointer`, through an empty volatile asm statement, as a value LLVM cannot see through.

    Why: where a loop's loads are the same on every pass (a group's keys for every query row),
    LLVM hoists them out of the loop, keeps more operands than the 32 vector registers hold and
    spills them to the stack with unaligned 64-byte moves. The stack's alignment then decides the
    speed, and it differs by process (the environment's size shifts it): the scores of 27 rows
    by 512 keys took 20 us in one process, 37 us in the next. Loads from a pointer re-made on each
    pass cannot be hoisted: 15 us in every process (bench/history/2026-11-23-24-cpu-vs-llamacpp-avx512.md)."""
    return builder.asm(ir.FunctionType(pointer.type, [pointer.type]), "", "=r,0", [pointer], side_effect=True)


def row_pointers(builder, array, first, start, count, hide=False):
    """Byte pointers to element `start` of rows first .. first + count - 1 of a 2-D uint16
    array (its numba array struct): a group of keys. hide: through `opaque`, so loads from them
    are never hoisted out of the caller's loop."""
    data = opaque(builder, array.data) if hide else array.data
    base = builder.bitcast(data, ir.IntType(8).as_pointer())
    row_bytes = builder.extract_value(array.strides, 0)
    start_byte = builder.mul(start, ir.Constant(start.type, 2))
    return [builder.gep(base, [builder.add(builder.mul(builder.add(first, ir.Constant(first.type, j)), row_bytes),
                                           start_byte)]) for j in range(count)]


def _operand(context, builder, array_type, array, start):
    """32 bfloat16 values of a 1-D uint16 array from index `start`, as the instruction's operand."""
    return operand_at(builder, builder.gep(context.make_array(array_type)(context, builder, array).data, [start]))


@intrinsic
def dot_step(typingctx, acc, w, x, start):
    """acc + the pairwise products of w[start:start + 32] and x[start:start + 32] (bfloat16 bits)."""
    if acc != f32x16 or not all(isinstance(a, types.Array) and a.dtype == types.uint16 for a in (w, x)):
        return None

    def codegen(context, builder, signature, args):
        return builder.call(dot_instruction(builder), [args[0], _operand(context, builder, signature.args[1], args[1], args[3]),
                                 _operand(context, builder, signature.args[2], args[2], args[3])])

    return f32x16(acc, w, x, start), codegen


@intrinsic
def _sum_lanes(typingctx, a, b):
    """The sum of the 32 lanes of a and b in one fixed order (lane halves added pairwise)."""
    if a != f32x16 or b != f32x16:
        return None

    def codegen(context, builder, signature, args):
        return lane_tree(builder, builder.fadd(args[0], args[1]))

    return types.float32(a, b), codegen


@intrinsic
def sum16(typingctx, acc):
    """The sum of acc's 16 lanes, in lane_tree's order."""
    if acc != f32x16:
        return None
    return types.float32(acc), lambda context, builder, signature, args: lane_tree(builder, args[0])


def splat(builder, value, vector_type):
    """`value` in every lane of a `vector_type` vector."""
    one = builder.insert_element(ir.Constant(vector_type, None), value, ir.Constant(ir.IntType(32), 0))
    lanes = ir.Constant(ir.VectorType(ir.IntType(32), vector_type.count), [0] * vector_type.count)
    return builder.shuffle_vector(one, one, lanes)


def dot_instruction(builder):
    """The declaration of vdpbf16ps (512 bits) in the function's module."""
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(LANES, [LANES, OPERAND, OPERAND]),
                                          "llvm.x86.avx512bf16.dpbf16ps.512")


@numba.njit(inline="always")
def dot(w, x, width):
    """w . x for bfloat16 bits, width a multiple of PAIR_BLOCK: pairs of products, float32 sums."""
    a0, a1 = zeros(), zeros()
    for k in range(0, width, PAIR_BLOCK):
        a0 = dot_step(a0, w, x, k)
        a1 = dot_step(a1, w, x, k + 32)
    return _sum_lanes(a0, a1)


@numba.njit(inline="always")
def dot4(w, x0, x1, x2, x3, width):
    """dot of w with four rows, each through the same steps as alone; w is loaded once."""
    a0, a1, b0, b1 = zeros(), zeros(), zeros(), zeros()
    c0, c1, d0, d1 = zeros(), zeros(), zeros(), zeros()
    for k in range(0, width, PAIR_BLOCK):
        a0, a1 = dot_step(a0, w, x0, k), dot_step(a1, w, x0, k + 32)
        b0, b1 = dot_step(b0, w, x1, k), dot_step(b1, w, x1, k + 32)
        c0, c1 = dot_step(c0, w, x2, k), dot_step(c1, w, x2, k + 32)
        d0, d1 = dot_step(d0, w, x3, k), dot_step(d1, w, x3, k + 32)
    return _sum_lanes(a0, a1), _sum_lanes(b0, b1), _sum_lanes(c0, c1), _sum_lanes(d0, d1)




@numba.njit(cache=True)
def bf16_rows(x):
    """x (float32 [rows, width] holding bfloat16 values) as bfloat16 bits: exact for such values."""
    bits = np.empty(x.shape, np.uint16)
    for i in range(x.shape[0]):
        for j in range(x.shape[1]):
            bits[i, j] = narrow(x[i, j], bits)
    return bits

