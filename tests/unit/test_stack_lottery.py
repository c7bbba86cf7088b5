"""The stack-lottery benchmark's kernels run on this CPU's dtype, and its flags fail clearly."""
import numba
import pytest
from click.testing import CliRunner

from triforce.bench import stack_lottery
from triforce.kernels.cpu.bf16_dot import HAS_BF16_DOT
from triforce.kernels.cpu.f32_dot import HAS_F32_FMA

DTYPES = [d for d, ok in (("bfloat16", HAS_BF16_DOT), ("float32", HAS_F32_FMA)) if ok]


@pytest.mark.skipif(not DTYPES, reason="neither AVX512-BF16 nor FMA on this CPU")
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_timed_kernel_runs(dtype):
    threads = numba.get_num_threads()
    try:
        kernels = stack_lottery._kernels(3, dtype)  # sets numba's pool to one thread
        assert len(kernels) == 6
        for _, call in kernels:
            call()
    finally:
        numba.set_num_threads(threads)


@pytest.mark.parametrize("pads", ["x,16", "0,-16"])
def test_bad_pads_are_a_usage_error(pads):
    result = CliRunner().invoke(stack_lottery.main, ["--pads", pads])
    assert result.exit_code == 2 and "--pads" in result.output
