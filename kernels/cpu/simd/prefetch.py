"""Software prefetch for the CPU kernels: ask for rows of an array a little before they are read.

Why: a decoding or verify job of the attention kernel reads its 512 keys in groups of 16 rows
(a group's rows side by side), and the hardware prefetchers did not keep ahead of that: at 32K
tokens a 27-row job took 33 us where its keys and values sat in L3 and 26 us in cache (one
thread; bench/RESULTS.md). Asking for the rows 64 keys ahead while a group is scored takes the
wait away."""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

_LINE = 64  # bytes per cache line
_INT32 = ir.IntType(32)


@intrinsic
def ask_rows(typingctx, a, first, count):
    """Hint that rows first .. first + count - 1 of `a` (2-D, any dtype) will be read soon: one
    prefetch per cache line of the bytes they span, into L2 (prefetcht1; into L1 as well was
    slower: 32K tokens, 30 layers, 9 tokens 84 -> 90 ms, 1 token 27 -> 30 ms). A hint never faults,
    so rows past the array's end (the last groups of a job) cost a wasted request, nothing more."""
    if not (isinstance(a, types.Array) and a.ndim == 2):
        return None

    def codegen(context, builder, signature, args):
        arr = context.make_array(signature.args[0])(context, builder, args[0])
        row_bytes = builder.extract_value(arr.strides, 0)
        base = builder.bitcast(arr.data, ir.IntType(8).as_pointer())
        start, end = builder.mul(args[1], row_bytes), builder.mul(builder.add(args[1], args[2]), row_bytes)
        hint = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [
            ir.IntType(8).as_pointer(), _INT32, _INT32, _INT32]), "llvm.prefetch.p0i8")
        with cgutils.for_range_slice(builder, start, end, ir.Constant(start.type, _LINE)) as (offset, _):
            # read access, locality 2 (prefetcht1), data cache
            builder.call(hint, [builder.gep(base, [offset]), ir.Constant(_INT32, 0), ir.Constant(_INT32, 2),
                                ir.Constant(_INT32, 1)])
        return context.get_dummy_value()

    return types.none(a, types.intp, types.intp), codegen


# The small-rows linear kernels (bf16_dot, f32_dot) ask for the weight row ASK_AHEAD rows on as
# they start each row, when a call has ASK_FROM_ROWS input rows or more: there a row's work is long
# enough that the weights stopped streaming at the memory's pace. The default model's projections
# (30 layers and the head, weights in memory, two threads), bfloat16 / float32 ms: 5 rows
# 10.6 -> 7.9 / 21.7 -> 18.3, 9 rows 17.1 -> 11.4 / 38.3 -> 23.9; at 1 and 2 rows the hint cost
# up to 10% and is not given.
ASK_AHEAD = 8
ASK_FROM_ROWS = 3
