"""One block of quantized weights against 32 float32 inputs, on explicit vectors: 8 lanes (AVX2 and
FMA, as triforce.kernels.cpu.simd.f32_dot) or 16 (AVX-512), chosen by the accumulator's type.

Why: left to LLVM's vectoriser, unpacking nibbles and bytes and multiplying them into float sums
ran at about 2.5 G weights/s on two Zen 3 cores (a fifth of what float32 rows stream at). Here a
4-bit block is one 16-byte load, split into low and high nibbles, widened to float vectors
(byte j holds weights j and j + 16: 8 lanes take weights 0-7, 8-15, 16-23, 24-31; 16 lanes 0-15
and 16-31) and multiplied into the inputs by fused multiply-adds; a Q8_0 block is one 32-byte load
of signed bytes. 16 lanes take half the widening, conversion and multiply instructions of 8 for a
block, which is what bounds these kernels (bench/RESULTS.md, "16 lanes"). The block's sum of q x
is scaled by its d into a running accumulator, so every block of a row takes the same steps in the
same order, whatever else the call computes; the lane count is part of the bits (one per host).
The arrays are whole C-contiguous matrices and the starts flat element indices: a row view made
per weight row cost each row a reference count taken and dropped on the array both threads share
(bench/RESULTS.md, "Views per row")."""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from triforce.kernels.cpu.simd.bf16_dot import f32x16, splat
from triforce.kernels.cpu.simd.f32_dot import f32x8
from triforce.kernels.cpu.simd.features import kernels_may_use
from triforce.kernels.cpu.simd.lanes import lane_tree

# 16-lane blocks where numba may use AVX-512 (the host's, see features.kernels_may_use)
WIDE_BLOCKS = kernels_may_use("avx512f", "fma")

_I32 = ir.IntType(32)


def _lanes_of(acc) -> int | None:
    """The lanes of an accumulator type (f32x8 or f32x16), else None."""
    return 8 if acc == f32x8 else 16 if acc == f32x16 else None


def _floats(lanes: int) -> ir.VectorType:
    return ir.VectorType(ir.FloatType(), lanes)


def _mask(lanes):
    return ir.Constant(ir.VectorType(_I32, len(lanes)), lanes)


def _fma(builder, lanes: int):
    """The declaration of llvm.fma on `lanes` float32 lanes in the function's module."""
    vector = _floats(lanes)
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(vector, [vector] * 3),
                                          f"llvm.fma.v{lanes}f32")


def _load(context, builder, array_type, array, start, vector):
    data = context.make_array(array_type)(context, builder, array).data
    return builder.load(builder.bitcast(builder.gep(data, [start]), vector.as_pointer()), align=1)


def _inputs(context, builder, x_type, x, xstart, lanes, count):
    """`count` vectors of `lanes` float32 inputs from x[xstart], one after the other."""
    return [_load(context, builder, x_type, x, builder.add(xstart, ir.Constant(xstart.type, lanes * k)),
                  _floats(lanes)) for k in range(count)]


def _dot(builder, weights, xs, lanes):
    """sum over k of weights[k] * xs[k], lane by lane: a product, then fused multiply-adds."""
    dot = builder.fmul(weights[0], xs[0])
    for w, xv in zip(weights[1:], xs[1:]):
        dot = builder.call(_fma(builder, lanes), [w, xv, dot])
    return dot


def _scaled_dots(context, builder, signature, args, weights, lanes):
    """Every input row's acc + d * (sum over k of weights[k] * x[row's start + lanes k : + lanes]),
    the weights unpacked once: args are (accs, quants, qstart, x, xstart, width, d), accs a tuple
    of one accumulator per row, row k's inputs from xstart + k width. Each row takes the steps it
    would take alone (a product, fused multiply-adds in order, then d into its accumulator)."""
    accs, x_type, x, xstart, width = args[0], signature.args[3], args[3], args[4], args[5]
    d = splat(builder, args[6], _floats(lanes))
    out = []
    for row in range(len(signature.args[0])):
        start = builder.add(xstart, builder.mul(width, ir.Constant(width.type, row)))
        xs = _inputs(context, builder, x_type, x, start, lanes, len(weights))
        acc = builder.extract_value(accs, row)
        out.append(builder.call(_fma(builder, lanes), [d, _dot(builder, weights, xs, lanes), acc]))
    return context.make_tuple(builder, signature.return_type, out)


def _nibbles(builder, raw, lanes):
    """The 32 weights of 16 bytes of nibbles (byte j: weight j low, j + 16 high) as float vectors of
    `lanes`, in weight order."""
    if lanes == 16:
        wide = builder.zext(raw, ir.VectorType(_I32, 16))
        low = builder.and_(wide, ir.Constant(wide.type, [15] * 16))
        high = builder.lshr(wide, ir.Constant(wide.type, [4] * 16))
        return [builder.uitofp(v, _floats(16)) for v in (low, high)]
    low = builder.and_(raw, ir.Constant(raw.type, [15] * 16))
    high = builder.lshr(raw, ir.Constant(raw.type, [4] * 16))
    return [builder.uitofp(builder.shuffle_vector(v, v, _mask(list(range(h, h + 8)))), _floats(8))
            for v in (low, high) for h in (0, 8)]


def _signed_bytes(builder, raw, width, lanes):
    """`width` signed bytes as float vectors of `lanes`, in order."""
    return [builder.sitofp(builder.shuffle_vector(raw, raw, _mask(list(range(h, h + lanes)))), _floats(lanes))
            for h in range(0, width, lanes)]


def _is_c_array(a, dtype) -> bool:
    return isinstance(a, types.Array) and a.dtype == dtype and a.layout == "C"


_I8x16 = ir.VectorType(ir.IntType(8), 16)
_MOST_ROWS = 4  # rows a block's unpacking serves: groups of 5-8 spilled registers (AVX2: 8 rows 30 ms, 4 + 4 19)


def _rows_fit(accs, quants, quant_type, x, width, d) -> int | None:
    """The lanes of a call's accumulators where its arguments fit a block intrinsic, else None."""
    if not isinstance(accs, types.UniTuple) or not 1 <= len(accs) <= _MOST_ROWS:
        return None
    lanes = _lanes_of(accs.dtype)
    if lanes is None or not (_is_c_array(quants, quant_type) and _is_c_array(x, types.float32)) \
            or not isinstance(width, types.Integer) or d != types.float32:
        return None
    return lanes


@intrinsic
def q4_rows(typingctx, accs, quants, qstart, x, xstart, width, d):
    """(acc + d * (q . x[row's 32 inputs]) for each accumulator in accs, 1 to _MOST_ROWS input
    rows, row k's inputs at flat index xstart + k width): the block's 32 nibbles at
    quants[qstart:qstart + 16] (uint8: weight j low, j + 16 high), unpacked once, unsigned (the
    caller subtracts a bias through x's sum); starts are flat indices into C-contiguous arrays."""
    lanes = _rows_fit(accs, quants, types.uint8, x, width, d)
    if lanes is None:
        return None

    def codegen(context, builder, signature, args):
        raw = _load(context, builder, signature.args[1], args[1], args[2], _I8x16)
        return _scaled_dots(context, builder, signature, args, _nibbles(builder, raw, lanes), lanes)

    return accs(accs, quants, qstart, x, xstart, width, d), codegen


def _signed_bytes_rows(width: int):
    """An intrinsic (accs, quants, qstart, x, xstart, row_width, d) -> q4_rows' sums for `width`
    (32 or 16) signed bytes at quants[qstart:], converted once for every row."""
    vector = ir.VectorType(ir.IntType(8), width)

    def block(typingctx, accs, quants, qstart, x, xstart, row_width, d):
        lanes = _rows_fit(accs, quants, types.int8, x, row_width, d)
        if lanes is None:
            return None

        def codegen(context, builder, signature, args):
            raw = _load(context, builder, signature.args[1], args[1], args[2], vector)
            return _scaled_dots(context, builder, signature, args, _signed_bytes(builder, raw, width, lanes), lanes)

        return accs(accs, quants, qstart, x, xstart, row_width, d), codegen

    block.__name__ = f"q8_rows{width}"
    return intrinsic(block)


q8_rows = _signed_bytes_rows(32)     # Q8_0 blocks
q8_rows16 = _signed_bytes_rows(16)   # Q6_K blocks (a scale per 16 weights)


@intrinsic
def block_total(typingctx, acc):
    """The sum of an accumulator's lanes in lane_tree's order (8 lanes: after adding zeros, as
    f32_dot.sum_lanes8 of it and zeros8 sums)."""
    lanes = _lanes_of(acc)
    if lanes is None:
        return None

    def codegen(context, builder, signature, args):
        v = args[0]
        if lanes == 8:
            v = builder.fadd(v, ir.Constant(_floats(8), None))
        return lane_tree(builder, v)

    return types.float32(acc), codegen
