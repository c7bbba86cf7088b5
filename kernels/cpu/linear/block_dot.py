"""One block of quantized weights against 32 float32 inputs, on explicit 8-lane vectors (AVX2 and
FMA, as triforce.kernels.cpu.simd.f32_dot).

Why: left to LLVM's vectoriser, unpacking nibbles and bytes and multiplying them into float sums
ran at about 2.5 G weights/s on two Zen 3 cores (a fifth of what float32 rows stream at). Here a
4-bit block is one 16-byte load, split into low and high nibbles, widened to four 8-lane float
vectors (weights 0-7, 8-15, 16-23, 24-31: byte j holds j and j + 16) and multiplied into the
inputs by fused multiply-adds; a Q8_0 block is one 32-byte load of signed bytes. The block's sum
of q x is scaled by its d into a running 8-lane accumulator, so every block of a row takes the
same steps in the same order, whatever else the call computes."""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from triforce.kernels.cpu.simd.f32_dot import LANES8, f32x8, fma_instruction, is_f32_row, load8

_I8x16 = ir.VectorType(ir.IntType(8), 16)
_I32 = ir.IntType(32)


def _mask(lanes):
    return ir.Constant(ir.VectorType(_I32, len(lanes)), lanes)


def _bytes(context, builder, array_type, array, start, vector):
    data = context.make_array(array_type)(context, builder, array).data
    return builder.load(builder.bitcast(builder.gep(data, [start]), vector.as_pointer()), align=1)


def _splat(builder, value):
    one = builder.insert_element(ir.Constant(LANES8, None), value, ir.Constant(_I32, 0))
    return builder.shuffle_vector(one, one, _mask([0] * 8))


def _scaled_dot(context, builder, signature, args, weights8):
    """acc + d * (sum over k of weights8[k] * x[xstart + 8k : + 8]) for the 8-lane weights (four
    for a 32-weight block, two for 16)."""
    acc, x, xstart, d = args[0], args[3], args[4], args[5]
    fma = fma_instruction(builder)
    xs = [load8(context, builder, signature.args[3], x, builder.add(xstart, ir.Constant(xstart.type, 8 * k)))
          for k in range(len(weights8))]
    dot = builder.fmul(weights8[0], xs[0])
    for w, xv in zip(weights8[1:], xs[1:]):
        dot = builder.call(fma, [w, xv, dot])
    return builder.call(fma, [_splat(builder, d), dot, acc])


def _scaled_dots4(context, builder, signature, args, weights8):
    """_scaled_dot for four input rows at once, the weights unpacked once: args are
    (a0, a1, a2, a3, quants, qstart, x0, x1, x2, x3, xstart, d); each row takes the steps it
    would take alone."""
    fma = fma_instruction(builder)
    xstart, d = args[10], _splat(builder, args[11])
    out = []
    for row in range(4):
        x, x_type = args[6 + row], signature.args[6 + row]
        xs = [load8(context, builder, x_type, x, builder.add(xstart, ir.Constant(xstart.type, 8 * k))) for k in range(4)]
        dot = builder.fmul(weights8[0], xs[0])
        for w, xv in zip(weights8[1:], xs[1:]):
            dot = builder.call(fma, [w, xv, dot])
        out.append(builder.call(fma, [d, dot, args[row]]))
    return context.make_tuple(builder, signature.return_type, out)


def _nibbles8(builder, raw):
    low = builder.and_(raw, ir.Constant(_I8x16, [15] * 16))
    high = builder.lshr(raw, ir.Constant(_I8x16, [4] * 16))
    return [builder.uitofp(builder.shuffle_vector(v, v, _mask(list(range(h, h + 8)))), LANES8)
            for v in (low, high) for h in (0, 8)]


@intrinsic
def q4_block4(typingctx, a0, a1, a2, a3, quants, qstart, x0, x1, x2, x3, xstart, d):
    """q4_block for four input rows, the block's nibbles unpacked once."""
    rows = (x0, x1, x2, x3)
    if any(a != f32x8 for a in (a0, a1, a2, a3)) or not _is_bytes_row(quants, types.uint8) \
            or not all(is_f32_row(x) for x in rows) or d != types.float32:
        return None

    def codegen(context, builder, signature, args):
        raw = _bytes(context, builder, signature.args[4], args[4], args[5], _I8x16)
        return _scaled_dots4(context, builder, signature, args, _nibbles8(builder, raw))

    return types.UniTuple(f32x8, 4)(a0, a1, a2, a3, quants, qstart, x0, x1, x2, x3, xstart, d), codegen


def _is_bytes_row(a, dtype) -> bool:
    return isinstance(a, types.Array) and a.dtype == dtype and a.ndim == 1 and a.layout == "C"


@intrinsic
def q4_block(typingctx, acc, quants, qstart, x, xstart, d):
    """acc + d * (q . x[xstart:xstart + 32]), the block's 32 nibbles at quants[qstart:qstart + 16]
    (uint8: weight j low, j + 16 high), unsigned (the caller subtracts a bias through x's sum)."""
    if acc != f32x8 or not (_is_bytes_row(quants, types.uint8) and is_f32_row(x)) or d != types.float32:
        return None

    def codegen(context, builder, signature, args):
        raw = _bytes(context, builder, signature.args[1], args[1], args[2], _I8x16)
        return _scaled_dot(context, builder, signature, args, _nibbles8(builder, raw))

    return f32x8(acc, quants, qstart, x, xstart, d), codegen


def _signed_bytes_block(width: int):
    """An intrinsic (acc, quants, qstart, x, xstart, d) -> acc + d * (q . x[xstart:xstart + width])
    for `width` (32 or 16) signed bytes at quants[qstart:]."""
    vector = ir.VectorType(ir.IntType(8), width)

    def block(typingctx, acc, quants, qstart, x, xstart, d):
        if acc != f32x8 or not (_is_bytes_row(quants, types.int8) and is_f32_row(x)) or d != types.float32:
            return None

        def codegen(context, builder, signature, args):
            raw = _bytes(context, builder, signature.args[1], args[1], args[2], vector)
            weights8 = [builder.sitofp(builder.shuffle_vector(raw, raw, _mask(list(range(h, h + 8)))), LANES8)
                        for h in range(0, width, 8)]
            return _scaled_dot(context, builder, signature, args, weights8)

        return f32x8(acc, quants, qstart, x, xstart, d), codegen

    block.__name__ = f"q8_block{width}"
    return intrinsic(block)


q8_block = _signed_bytes_block(32)     # a Q8_0 block
q8_block16 = _signed_bytes_block(16)   # a Q6_K block (a scale per 16 weights)
