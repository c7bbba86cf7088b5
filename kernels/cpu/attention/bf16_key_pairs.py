"""Attention scores of many query rows on 16 keys at once, with the keys turned pair by pair
(AVX512-BF16's `vdpbf16ps`, see triforce.kernels.cpu.simd.bf16_dot), for verify passes.

Why: triforce.kernels.cpu.attention.bf16_scores gives each key its own accumulator, so the 16 keys of a group
end in 16 vectors whose lanes must be summed across: 15 shuffle pairs and 15 additions per row
and group beside 32 dot instructions (head dim 64), and a verify pass of 27 rows spent more on
those than on the dots. Here the group's keys are turned once for all rows: operand p holds pair
p (dims 2p, 2p + 1) of all 16 keys, one key per lane, and the query's pair p goes into every lane.
A chain over pairs i, i + 16, ... then holds, for every key at once, what lane i of bf16_scores'
per-key accumulator holds, and adding the chains lane by lane in lane_tree's pairs (i with
i + 8, then + 4, + 2, + 1) gives that kernel's bits with no shuffle per row. Three rows share
each operand's load. Per 512 keys of head dim 64: 27 rows 15.2 -> 9.6 us, 9 rows 5.4 -> 4.3,
3 rows 2.4 -> 2.6 (the turn, 1.5 us, pays from about five rows on)."""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from triforce.kernels.cpu.simd.bf16_dot import LANES, OPERAND, dot_instruction, opaque, row_pointers, splat

GROUP = 16  # keys per group: one vector of scores
TURNED_BLOCKS = (1, 2, 4)  # 32-dim blocks score_rows unrolls: head dims 32, 64 and 128
_INTS = ir.VectorType(ir.IntType(32), 16)  # 16 pairs of bfloat16 values, as loaded


def _mask(picks):
    return ir.Constant(_INTS, picks)


# The masks of a 16 x 16 transpose in in-lane unpacks and 128-bit lane moves (cheaper than
# whole-vector permutes, 2.2 -> 1.5 us per 512 keys): indices into the two sources' 32 values.
_LO32 = _mask([x for L in range(4) for x in (4 * L, 16 + 4 * L, 4 * L + 1, 17 + 4 * L)])
_HI32 = _mask([x for L in range(4) for x in (4 * L + 2, 18 + 4 * L, 4 * L + 3, 19 + 4 * L)])
_LO64 = _mask([x for L in range(4) for x in (4 * L, 4 * L + 1, 16 + 4 * L, 17 + 4 * L)])
_HI64 = _mask([x for L in range(4) for x in (4 * L + 2, 4 * L + 3, 18 + 4 * L, 19 + 4 * L)])
_EVEN = _mask([4 * lane + e for lane in (0, 2, 4, 6) for e in range(4)])  # 128-bit lanes 0, 2 of each
_ODD = _mask([4 * lane + e for lane in (1, 3, 5, 7) for e in range(4)])


def _transpose(builder, rows):
    """16 vectors of 16 lanes, turned: lane j of result p is lane p of rows[j]."""
    shuffle = builder.shuffle_vector
    t = [shuffle(rows[2 * (i // 2)], rows[2 * (i // 2) + 1], _HI32 if i % 2 else _LO32) for i in range(16)]
    u = []
    for i in range(4):
        for a, b in ((t[4 * i], t[4 * i + 2]), (t[4 * i + 1], t[4 * i + 3])):
            u += [shuffle(a, b, _LO64), shuffle(a, b, _HI64)]
    out = [None] * 16
    for c in range(4):
        p0, p1 = shuffle(u[c], u[4 + c], _EVEN), shuffle(u[c], u[4 + c], _ODD)
        q0, q1 = shuffle(u[8 + c], u[12 + c], _EVEN), shuffle(u[8 + c], u[12 + c], _ODD)
        out[c], out[8 + c] = shuffle(p0, q0, _EVEN), shuffle(p0, q0, _ODD)
        out[4 + c], out[12 + c] = shuffle(p1, q1, _EVEN), shuffle(p1, q1, _ODD)
    return out


def _data(context, builder, array_type, array):
    return context.make_array(array_type)(context, builder, array)


@intrinsic
def turn_block(typingctx, k, first, turned, start):
    """turned[32 * p + 2 * j + e] = k[first + j, 2 * p + e] for the 16 pairs p from start // 2,
    j < 16, e < 2 (k 2-D uint16 with contiguous rows, turned 1-D uint16 of 16 * dim values)."""
    if not (isinstance(k, types.Array) and k.dtype == types.uint16 and k.ndim == 2):
        return None

    def codegen(context, builder, signature, args):
        keys, first_key, out, start_at = args
        key_array = _data(context, builder, signature.args[0], keys)
        vectors = _transpose(builder, [builder.load(builder.bitcast(at, _INTS.as_pointer()), align=2)
                                       for at in row_pointers(builder, key_array, first_key, start_at, GROUP)])
        target = _data(context, builder, signature.args[2], out).data
        for p, vector in enumerate(vectors):
            offset = builder.add(builder.mul(start_at, ir.Constant(start_at.type, 16)),
                                 ir.Constant(start_at.type, 32 * p))
            builder.store(vector, builder.bitcast(builder.gep(target, [offset]), _INTS.as_pointer()), align=2)
        return context.get_dummy_value()

    return types.none(k, first, turned, start), codegen


@intrinsic
def score_rows(typingctx, turned, q, r, scale, out, first, size, blocks):
    """out[r + j, first:first + 16] = scale * (q[r + j] . each of the 16 turned keys) for j < size,
    dims 32 * blocks (size literal; blocks one of TURNED_BLOCKS, each unrolled). The rows share
    each turned operand's load; a row's lanes sum in bf16_scores' order: lane i's pairs i,
    i + 16, ... in a chain, then lane i + 8 added to lane i, then + 4, + 2, + 1, then the scale."""
    if not isinstance(size, types.IntegerLiteral):
        return None
    rows = size.literal_value

    def codegen(context, builder, signature, args):
        keys, query, row, sc, o, first_key, _, width = args
        # re-made on every call, so LLVM cannot hoist the group's operands out of the row loop
        # and spill them (see bf16_dot.opaque)
        base = opaque(builder, _data(context, builder, signature.args[0], keys).data)
        q_array = _data(context, builder, signature.args[1], query)
        q_pairs = builder.bitcast(q_array.data, ir.IntType(32).as_pointer())
        row_pairs = builder.sdiv(builder.extract_value(q_array.strides, 0), ir.Constant(row.type, 4))
        index = lambda n: ir.Constant(row.type, n)  # noqa: E731

        def dot(acc, p, j):
            key = builder.load(builder.bitcast(builder.gep(base, [index(32 * p)]), _INTS.as_pointer()), align=2)
            at = builder.add(builder.mul(builder.add(row, index(j)), row_pairs), index(p))
            q_pair = splat(builder, builder.load(builder.gep(q_pairs, [at]), align=2), _INTS)
            return builder.call(dot_instruction(builder), [acc, builder.bitcast(key, OPERAND), builder.bitcast(q_pair, OPERAND)])

        def rows_of(blocks):
            """The rows' score vectors for head dim 32 * blocks."""
            zero = ir.Constant(LANES, None)
            lanes = [[None] * (GROUP // 2) for _ in range(rows)]
            for i in range(GROUP // 2):  # lanes i and i + 8 of every row, then their sum
                chains = [[zero, zero] for _ in range(rows)]
                for b in range(blocks):
                    for h, lane in enumerate((i, i + GROUP // 2)):
                        for j in range(rows):
                            chains[j][h] = dot(chains[j][h], GROUP * b + lane, j)
                for j in range(rows):
                    lanes[j][i] = builder.fadd(chains[j][0], chains[j][1])
            sums = []
            for vectors in lanes:
                while len(vectors) > 1:
                    half = len(vectors) // 2
                    vectors = [builder.fadd(vectors[i], vectors[i + half]) for i in range(half)]
                sums.append(builder.fmul(vectors[0], splat(builder, sc, LANES)))
            return sums

        out_array = _data(context, builder, signature.args[4], o)

        def store(sums):
            for j, vector in enumerate(sums):
                at = cgutils.get_item_pointer(context, builder, signature.args[4], out_array,
                                              [builder.add(row, index(j)), first_key], wraparound=False)
                builder.store(vector, builder.bitcast(at, LANES.as_pointer()), align=4)

        def unrolled(choices):  # one branch per block count, the last taken for any other
            if len(choices) == 1:
                return store(rows_of(choices[0]))
            with builder.if_else(builder.icmp_signed("==", width, ir.Constant(width.type, choices[0]))) as (this, rest):
                with this:
                    store(rows_of(choices[0]))
                with rest:
                    unrolled(choices[1:])

        unrolled(TURNED_BLOCKS)
        return context.get_dummy_value()

    return types.none(turned, q, types.intp, scale, out, types.intp, size, types.intp), codegen


@intrinsic
def turn_scores(typingctx, scores, scale, out, row, first, count):
    """out[row + r, first:first + 16] = scale * scores[:, r] for r < count: a tile of 16 keys x
    16 query rows of sums (scores float32 [16, 16], C-contiguous) turned into rows of out
    (float32, 2-D, rows contiguous) by the same in-register transpose as turn_block."""
    def codegen(context, builder, signature, args):
        source, sc, target, row_at, first_key, rows = args
        data = builder.bitcast(_data(context, builder, signature.args[0], source).data, _INTS.as_pointer())
        turned = _transpose(builder, [builder.load(builder.gep(data, [ir.Constant(ir.IntType(64), j)]), align=4)
                                      for j in range(GROUP)])
        out_array = _data(context, builder, signature.args[2], target)
        factor = splat(builder, sc, LANES)
        for r, vector in enumerate(turned):
            with builder.if_then(builder.icmp_signed(">", rows, ir.Constant(rows.type, r))):
                at = cgutils.get_item_pointer(context, builder, signature.args[2], out_array,
                                              [builder.add(row_at, ir.Constant(row_at.type, r)), first_key],
                                              wraparound=False)
                builder.store(builder.fmul(builder.bitcast(vector, LANES), factor),
                              builder.bitcast(at, LANES.as_pointer()), align=4)
        return context.get_dummy_value()

    return types.none(scores, scale, out, types.intp, types.intp, types.intp), codegen
