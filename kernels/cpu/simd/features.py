"""The one CPU feature detection every kernel and `--dtype auto` read: the host's flags from
/proc/cpuinfo (x86 flags, Arm Features; LLVM's view of the host where that file is missing), and
whether numba's code may use them.

Which 16-bit formats the CPU multiplies natively follows from them. Where it does not, PyTorch's
CPU matrix products in that format are emulated (F.linear of 2048 rows by a 576 x 1536 matrix:
225 ms in bfloat16, 193 ms in float16, 32 ms in float32 on a 2-core AVX2 EPYC), so a prefill then
widens the weights (linear/dense.py) and `--dtype auto` picks bfloat16 only where it is native
(triforce.model.cpu_features)."""
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


_LLVM_NAMES = {"avx512bf16": "avx512_bf16", "avx512fp16": "avx512_fp16", "amx-bf16": "amx_bf16"}  # -> cpuinfo's


@lru_cache(maxsize=1)
def host_flags() -> frozenset[str]:
    """This machine's CPU flags, under /proc/cpuinfo's names."""
    try:
        return flags_in(Path("/proc/cpuinfo").read_text())
    except OSError:  # not Linux: ask LLVM, which reads the CPU itself
        from llvmlite import binding as llvm
        return frozenset(_LLVM_NAMES.get(name, name) for name, on in llvm.get_host_cpu_features().items() if on)


def kernels_may_use(*flags: str) -> bool:
    """Whether numba compiles for this CPU (its default) and the CPU has every one of `flags`: a
    portable build (NUMBA_CPU_NAME=generic, NUMBA_CPU_FEATURES) must run elsewhere, so no
    instruction of the host's alone goes into it."""
    import numba

    if numba.config.CPU_NAME not in (None, "host") or numba.config.CPU_FEATURES:
        return False
    return all(flag in host_flags() for flag in flags)


def native_matmul(dtype: torch.dtype, flags: frozenset[str] | None = None) -> bool:
    """Whether the CPU multiplies `dtype` in hardware; float32 and float64 always."""
    if dtype not in NATIVE_FLAGS:
        return True
    return bool(NATIVE_FLAGS[dtype] & (host_flags() if flags is None else flags))
