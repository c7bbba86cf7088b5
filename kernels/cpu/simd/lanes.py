"""Adding a vector's float32 lanes in one fixed order, shared by the dot kernels of every width
(16 lanes on AVX-512, 8 on AVX2): the order is part of each kernel's bits."""
from __future__ import annotations

from llvmlite import ir


def lane_tree(builder, v):
    """The sum of v's lanes: lane i with i + n/2, then i + n/4, ..., i + 1 (n = v's lanes)."""
    n = v.type.count
    while n > 1:
        half = n // 2
        low = ir.Constant(ir.VectorType(ir.IntType(32), half), list(range(half)))
        high = ir.Constant(ir.VectorType(ir.IntType(32), half), list(range(half, n)))
        v, n = builder.fadd(builder.shuffle_vector(v, v, low), builder.shuffle_vector(v, v, high)), half
    return builder.extract_element(v, ir.Constant(ir.IntType(32), 0))
