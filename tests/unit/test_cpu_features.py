"""--dtype auto on a CPU: bfloat16 where the CPU lists a bfloat16 dot-product feature."""
import pytest
import torch

from triforce.model import cpu_features
from triforce.model.loading import resolve_dtype

REAL_CHECK = cpu_features.native_bf16  # taken at import, before conftest's fixture replaces it

ZEN4 = "processor\t: 0\nflags\t\t: fpu sse avx2 avx512f avx512_bf16 avx512_vnni\n"
SKYLAKE = "processor\t: 0\nflags\t\t: fpu sse avx2 avx512f avx512bw\n"
SAPPHIRE = "flags\t\t: avx512f amx_tile amx_bf16 amx_int8\n"
NEOVERSE_V1 = "Features\t: fp asimd sve bf16 i8mm\n"
GRAVITON2 = "Features\t: fp asimd atomics\n"


@pytest.mark.parametrize("cpuinfo, native", [(ZEN4, True), (SAPPHIRE, True), (NEOVERSE_V1, True),
                                             (SKYLAKE, False), (GRAVITON2, False), ("", False)])
def test_flags_that_mean_native_bfloat16(cpuinfo, native):
    assert cpu_features.lists_bf16(cpuinfo) is native


@pytest.mark.parametrize("native, expected", [(True, torch.bfloat16), (False, torch.float32)])
def test_auto_follows_the_cpu(monkeypatch, native, expected):
    monkeypatch.setattr(cpu_features, "native_bf16", lambda: native)
    assert resolve_dtype("auto", torch.device("cpu")) == expected
    assert resolve_dtype("float32", torch.device("cpu")) == torch.float32  # a named dtype is kept
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16


def test_the_real_check_reads_this_machine():
    REAL_CHECK.cache_clear()
    try:
        text = open("/proc/cpuinfo").read()
    except OSError:
        text = ""
    assert REAL_CHECK() is cpu_features.lists_bf16(text)


@pytest.mark.parametrize("cpuinfo, bf16, fp16", [
    (ZEN4, True, False), (SAPPHIRE + "flags\t\t: avx512_fp16 amx_fp16\n", True, True), (SKYLAKE, False, False),
    ("Features\t: fp asimd asimdhp bf16\n", True, True), (GRAVITON2, False, False)])
def test_which_16bit_formats_a_cpu_multiplies_natively(cpuinfo, bf16, fp16):
    """The prefill's GEMMs widen 16-bit weights where these are False (triforce.kernels.cpu.linear.dense)."""
    from triforce.kernels.cpu.simd.features import flags_in, native_matmul

    flags = flags_in(cpuinfo)
    assert native_matmul(torch.bfloat16, flags) is bf16 and native_matmul(torch.float16, flags) is fp16
    assert native_matmul(torch.float32, flags) and native_matmul(torch.float64, flags)


def test_without_proc_cpuinfo_llvm_names_the_same_kernel_flags(monkeypatch):
    """The fallback reads the CPU through LLVM under /proc/cpuinfo's names: both sources agree on
    every flag a kernel asks for."""
    from triforce.kernels.cpu.simd import features as cpu_flags

    asked = ("fma", "avx2", "avx512_bf16")
    from_cpuinfo = cpu_flags.host_flags()

    class NoCpuinfo:
        def __init__(self, *_):
            pass

        def read_text(self):
            raise FileNotFoundError("/proc/cpuinfo")

    cpu_flags.host_flags.cache_clear()
    monkeypatch.setattr(cpu_flags, "Path", NoCpuinfo)
    try:
        from_llvm = cpu_flags.host_flags()
    finally:
        cpu_flags.host_flags.cache_clear()
    assert from_llvm and {f for f in asked if f in from_llvm} == {f for f in asked if f in from_cpuinfo}
