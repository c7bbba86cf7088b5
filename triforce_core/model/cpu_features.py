"""What the host CPU computes natively: `--dtype auto` picks bfloat16 where the CPU has bfloat16
dot-product instructions (x86 AVX512_BF16 or AMX-BF16, Arm BF16), since decoding reads every
weight per token and bfloat16 halves those bytes; elsewhere bfloat16 is emulated and float32
is the faster and exact choice."""
from __future__ import annotations

from functools import lru_cache

import torch

from triforce.kernels.cpu.simd.features import flags_in, native_matmul


@lru_cache(maxsize=1)
def native_bf16() -> bool:
    """Whether the CPU has a bfloat16 dot-product instruction (triforce.kernels.cpu.simd.features)."""
    return native_matmul(torch.bfloat16)


def lists_bf16(cpuinfo: str) -> bool:
    return native_matmul(torch.bfloat16, flags_in(cpuinfo))
