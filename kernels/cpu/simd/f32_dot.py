"""float32 dot products on explicit 8-lane vectors and fused multiply-adds, for CPUs without the
bfloat16 dot instruction (AVX2 and FMA: most x86 CPUs in use): the linear kernels'
(triforce.kernels.cpu.linear.dense) and the attention's.

Why: the widening kernels leave the sums to LLVM's vectoriser, which sums each dot across a
vector's lanes on its own; with several input rows (a verify pass of 9 tokens, a batch's rows)
the products then became compute-bound: a 960 x 576 projection of 9 rows ran at 8 GB/s where one
row streams at 28 (2-core Zen 3, float32). Here a weight row is loaded once for four input rows
(each with two accumulators: eight independent chains of FMAs), and every dot, alone or beside
others, runs the same steps: lane l of accumulator a takes the products of positions
16 * t + 8 * a + l in order of t, then the two accumulators are added and their lanes summed by one
fixed tree. So an input row's result never depends on the other rows of the call (a verify pass
computes each token as decoding it alone would), and LLVM, given no fast-math licence, keeps that
order.

A row may also be bfloat16 bits (uint16, as triforce.kernels.cpu.simd.bf16_bits passes them): its 8
values are widened as loaded (zero-extend, shift left 16: exact), so bfloat16 weights, keys and
values on such CPUs take the same steps and give the bits float32 copies of them would.

`HAS_F32_FMA` says whether numba compiles for a CPU with FMA; elsewhere callers keep their
widening kernels (llvm.fma would become a slow library call there)."""
from __future__ import annotations

import numba
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, models, register_model

from triforce.kernels.cpu.simd.features import kernels_may_use
from triforce.kernels.cpu.simd.lanes import lane_tree

STEP = 16  # values per step of a dot (two accumulators x 8 lanes): widths must be a multiple
LANES8 = ir.VectorType(ir.FloatType(), 8)
_BITS8 = ir.VectorType(ir.IntType(16), 8)
_WIDE8 = ir.VectorType(ir.IntType(32), 8)


HAS_F32_FMA = kernels_may_use("fma", "avx2")


class F32x8(types.Type):
    """8 float32 lanes in one register: an accumulator."""

    def __init__(self):
        super().__init__(name="F32x8")


f32x8 = F32x8()


@register_model(F32x8)
class _F32x8Model(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, LANES8)


@intrinsic
def zeros8(typingctx):
    return f32x8(), lambda context, builder, signature, args: ir.Constant(LANES8, None)


def fma_instruction(builder):
    """The declaration of llvm.fma on 8 float32 lanes in the function's module."""
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(LANES8, [LANES8] * 3), "llvm.fma.v8f32")


def vector_pointer(context, builder, array_type, array, start):
    """A pointer to 8-lane vectors at flat index `start` of a contiguous float32 array."""
    data = context.make_array(array_type)(context, builder, array).data
    return builder.bitcast(builder.gep(data, [start]), LANES8.as_pointer())


def load8(context, builder, array_type, array, start):
    """8 float32 values of a contiguous array (is_row, is_flat) from flat index `start`, as one
    vector: bfloat16 bits widened."""
    if array_type.dtype == types.float32:
        return builder.load(vector_pointer(context, builder, array_type, array, start), align=4)
    data = context.make_array(array_type)(context, builder, array).data
    bits = builder.load(builder.bitcast(builder.gep(data, [start]), _BITS8.as_pointer()), align=2)
    wide = builder.shl(builder.zext(bits, _WIDE8), ir.Constant(_WIDE8, [16] * 8))
    return builder.bitcast(wide, LANES8)


def is_f32_row(a) -> bool:
    return isinstance(a, types.Array) and a.dtype == types.float32 and a.ndim == 1 and a.layout == "C"


def is_row(a) -> bool:
    """A 1-D contiguous row of float32 values or of bfloat16 bits (uint16)."""
    return isinstance(a, types.Array) and a.dtype in (types.float32, types.uint16) and a.ndim == 1 and a.layout == "C"


@intrinsic
def fma_step(typingctx, acc, w, x, start):
    """acc + w[start:start + 8] * x[start:start + 8], lane by lane, each rounded once (either row
    may be bfloat16 bits: widened as loaded)."""
    if acc != f32x8 or not (is_row(w) and is_row(x)):
        return None

    def codegen(context, builder, signature, args):
        return builder.call(fma_instruction(builder), [
            load8(context, builder, signature.args[1], args[1], args[3]),
            load8(context, builder, signature.args[2], args[2], args[3]), args[0]])

    return f32x8(acc, w, x, start), codegen


def is_flat(a) -> bool:
    """A C-contiguous array of float32 values or bfloat16 bits, any shape: read at flat indices."""
    return isinstance(a, types.Array) and a.dtype in (types.float32, types.uint16) and a.layout == "C"


@intrinsic
def fma_at(typingctx, acc, w, wstart, x, xstart):
    """acc + w[wstart:wstart + 8] * x[xstart:xstart + 8] for arrays of any shape (is_flat), the
    starts flat indices: no row views, whose reference counts cost each row two atomic operations
    on a count both threads share (bench/RESULTS.md, "Views per row")."""
    if acc != f32x8 or not (is_flat(w) and is_flat(x)):
        return None

    def codegen(context, builder, signature, args):
        w8, x8 = (load8(context, builder, signature.args[k], args[k], args[k + 1]) for k in (1, 3))
        return builder.call(fma_instruction(builder), [w8, x8, args[0]])

    return f32x8(acc, w, wstart, x, xstart), codegen


@intrinsic
def sum_lanes8(typingctx, a, b):
    """The sum of the 16 lanes of a and b: a + b, then lane_tree."""
    if a != f32x8 or b != f32x8:
        return None

    def codegen(context, builder, signature, args):
        return lane_tree(builder, builder.fadd(args[0], args[1]))

    return types.float32(a, b), codegen


def _mask(lanes):
    return ir.Constant(ir.VectorType(ir.IntType(32), len(lanes)), lanes)


@intrinsic
def sum_lanes8x4(typingctx, a0, a1, b0, b1, c0, c1, d0, d1):
    """sum_lanes8 of (a0, a1), (b0, b1), (c0, c1) and (d0, d1), the four trees run side by side
    in shuffled vectors: each lane pair added is the one lane_tree adds, so the bits are the
    same as four sum_lanes8, in 7 additions and 8 shuffles where those take 16 and 24."""
    if any(arg != f32x8 for arg in (a0, a1, b0, b1, c0, c1, d0, d1)):
        return None

    def codegen(context, builder, signature, args):
        va, vb, vc, vd = (builder.fadd(args[i], args[i + 1]) for i in range(0, 8, 2))

        def fold(x, y, low, high):
            return builder.fadd(builder.shuffle_vector(x, y, _mask(low)), builder.shuffle_vector(x, y, _mask(high)))

        # lane i with i + 4: a's four sums then b's (and c's then d's)
        u = fold(va, vb, [0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15])
        w = fold(vc, vd, [0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15])
        # then i with i + 2: lanes a a c c b b d d
        x = fold(u, w, [0, 1, 8, 9, 4, 5, 12, 13], [2, 3, 10, 11, 6, 7, 14, 15])
        # then i with i + 1: lanes a c b d
        y = fold(x, x, [0, 2, 4, 6], [1, 3, 5, 7])
        lane = [builder.extract_element(y, ir.Constant(ir.IntType(32), i)) for i in (0, 2, 1, 3)]
        return context.make_tuple(builder, signature.return_type, lane)

    return types.UniTuple(types.float32, 4)(a0, a1, b0, b1, c0, c1, d0, d1), codegen


@numba.njit(inline="always")
def dot(w, x, width):
    """w . x for float32 rows, width a multiple of STEP, in the module's fixed order."""
    return dot_at(w, 0, x, 0, width)


@numba.njit(inline="always")
def dot4(w, x0, x1, x2, x3, width):
    """dot of w with four rows, each through the same steps as alone; w is read once."""
    a0, a1, b0, b1 = zeros8(), zeros8(), zeros8(), zeros8()
    c0, c1, d0, d1 = zeros8(), zeros8(), zeros8(), zeros8()
    for k in range(0, width, STEP):
        a0, a1 = fma_step(a0, w, x0, k), fma_step(a1, w, x0, k + 8)
        b0, b1 = fma_step(b0, w, x1, k), fma_step(b1, w, x1, k + 8)
        c0, c1 = fma_step(c0, w, x2, k), fma_step(c1, w, x2, k + 8)
        d0, d1 = fma_step(d0, w, x3, k), fma_step(d1, w, x3, k + 8)
    return sum_lanes8x4(a0, a1, b0, b1, c0, c1, d0, d1)


@numba.njit(inline="always")
def dot_at(w, wstart, x, xstart, width):
    """dot of the rows of w and x (is_flat arrays) that start at those flat indices."""
    a0, a1 = zeros8(), zeros8()
    for k in range(0, width, STEP):
        a0 = fma_at(a0, w, wstart + k, x, xstart + k)
        a1 = fma_at(a1, w, wstart + k + 8, x, xstart + k + 8)
    return sum_lanes8(a0, a1)


@numba.njit(inline="always")
def dot4_at(w, wstart, x, x0, x1, x2, x3, width):
    """dot4 of w's row at wstart with x's rows at x0 .. x3 (flat indices): the same steps."""
    a0, a1, b0, b1 = zeros8(), zeros8(), zeros8(), zeros8()
    c0, c1, d0, d1 = zeros8(), zeros8(), zeros8(), zeros8()
    for k in range(0, width, STEP):
        w0, w1 = wstart + k, wstart + k + 8
        a0, a1 = fma_at(a0, w, w0, x, x0 + k), fma_at(a1, w, w1, x, x0 + k + 8)
        b0, b1 = fma_at(b0, w, w0, x, x1 + k), fma_at(b1, w, w1, x, x1 + k + 8)
        c0, c1 = fma_at(c0, w, w0, x, x2 + k), fma_at(c1, w, w1, x, x2 + k + 8)
        d0, d1 = fma_at(d0, w, w0, x, x3 + k), fma_at(d1, w, w1, x, x3 + k + 8)
    return sum_lanes8x4(a0, a1, b0, b1, c0, c1, d0, d1)
