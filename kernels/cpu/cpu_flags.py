"""Which 16-bit formats the host CPU multiplies natively, from /proc/cpuinfo's flags (x86) or
Features (Arm). Where it does not, PyTorch's CPU matrix products in that format are emulated:
on a 2-core AVX2 EPYC, F.linear of 2048 rows by a 576 x 1536 matrix took 225 ms in bfloat16 and
193 ms in float16 against 32 ms in float32. So a prefill then widens the weights (cpu_linear),
and `--dtype auto` picks bfloat16 only where it is native (triforce.model.cpu_features)."""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import torch

NATIVE_FLAGS = {  # dot-product instructions on 16-bit inputs
    torch.bfloat16: frozenset({"avx512_bf16", "amx_bf16", "bf16"}),  # "bf16": an aarch64 Features word
    torch.float16: frozenset({"avx512_fp16", "amx_fp16", "asimdhp"}),
}


def flags_in(cpuinfo: str) -> frozenset[str]:
    words: set[str] = set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            words.update(value.split())
    return frozenset(words)


@lru_cache(maxsize=1)
def host_flags() -> frozenset[str]:
    """This machine's CPU flags (none where /proc/cpuinfo cannot be read)."""
    try:
        return flags_in(Path("/proc/cpuinfo").read_text())
    except OSError:
        return frozenset()


def native_matmul(dtype: torch.dtype, flags: frozenset[str] | None = None) -> bool:
    """Whether the CPU multiplies `dtype` in hardware; float32 and float64 always."""
    if dtype not in NATIVE_FLAGS:
        return True
    return bool(NATIVE_FLAGS[dtype] & (host_flags() if flags is None else flags))
