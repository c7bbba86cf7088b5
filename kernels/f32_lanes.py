"""Reductions over float32 rows, 16 lanes at a time, for the attention kernel's softmax.

Why: numba compiles `m = max(m, a[s])` to a scalar compare per element (LLVM does not vectorise
that float reduction here, fastmath or not): 7 us of a verify job's 44 (27 rows of 512 scores,
bench/stack_lottery.py), more than the scores' exponentials. Here 16 lanes keep their own
maxima, folded once at the end; a maximum is exact whatever the order, so the result is the
scalar loop's (NaN aside: a row holding one has no meaningful maximum either way)."""
from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from triforce.kernels.bf16_dot import LANES, f32x16

_WIDTH = 16


@intrinsic
def _load16(typingctx, a, start):
    """a[start:start + 16] as one vector (a 1-D contiguous float32 array)."""
    if not (isinstance(a, types.Array) and a.dtype == types.float32 and a.ndim == 1):
        return None

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        return builder.load(builder.bitcast(builder.gep(data, [args[1]]), LANES.as_pointer()), align=4)

    return f32x16(a, types.intp), codegen


@intrinsic
def _larger(typingctx, x, y):
    """Lane by lane, the larger of x and y."""
    if x != f32x16 or y != f32x16:
        return None

    def codegen(context, builder, signature, args):
        return builder.select(builder.fcmp_ordered(">", args[0], args[1]), args[0], args[1])

    return f32x16(x, y), codegen


@intrinsic
def _lane(typingctx, x, i):
    if x != f32x16:
        return None
    return types.float32(x, types.intp), lambda context, builder, signature, args: builder.extract_element(
        args[0], builder.trunc(args[1], ir.IntType(32)))


@numba.njit(cache=True)
def max_of(a, n):
    """The largest of a[:n] (n >= 1; a 1-D contiguous float32 array)."""
    full = n - n % _WIDTH
    top = a[0]
    if full:
        lanes = _load16(a, 0)
        for s in range(_WIDTH, full, _WIDTH):
            lanes = _larger(lanes, _load16(a, s))
        for i in range(_WIDTH):
            top = max(top, _lane(lanes, i))
    for s in range(full, n):
        top = max(top, a[s])
    return np.float32(top)
