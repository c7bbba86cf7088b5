"""What the host CPU computes natively: `--dtype auto` picks bfloat16 where the CPU has bfloat16
dot-product instructions (x86 AVX512_BF16 or AMX-BF16, Arm BF16), since decoding reads every
weight per token and bfloat16 halves those bytes; elsewhere bfloat16 is emulated and float32
is the faster and exact choice."""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path

_BF16_FLAGS = {"avx512_bf16", "amx_bf16", "bf16"}  # x86 flags; "bf16" in an aarch64 Features line


@lru_cache(maxsize=1)
def native_bf16() -> bool:
    """Whether /proc/cpuinfo lists a bfloat16 dot-product feature (False where it cannot be read)."""
    try:
        return lists_bf16(Path("/proc/cpuinfo").read_text())
    except OSError:
        return False


def lists_bf16(cpuinfo: str) -> bool:
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features") and _BF16_FLAGS & set(value.split()):
            return True
    return False
