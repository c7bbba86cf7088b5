"""The small-rows CPU linear kernels against F.linear, and the fused projections of the decoder
against its reference path (one nn.Linear per checkpoint matrix)."""
import pytest
import torch
import torch.nn.functional as F

from triforce.kernels.cpu.linear import dense as cpu_linear
from triforce.kernels.cpu.linear.dense import SMALL_ROWS, FusedLinear, linear


@pytest.fixture(autouse=True)
def _kernels_for_small_matrices(monkeypatch):
    monkeypatch.setattr(cpu_linear, "MIN_WEIGHTS", 1)  # the shapes below are small on purpose


def _reference(x, w, b):
    return F.linear(x.double(), w.double(), None if b is None else b.double())


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("rows", [1, 3, SMALL_ROWS])
@pytest.mark.parametrize("with_bias", [False, True])
def test_kernel_matches_float64(dtype, tol, rows, with_bias):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(37, 100, generator=g).to(dtype)  # widths that are no multiple of a vector
    b = torch.randn(37, generator=g).to(dtype) if with_bias else None
    x = torch.randn(1, rows, 100, generator=g).to(dtype)
    out = linear(x, w, b)
    assert out.shape == (1, rows, 37) and out.dtype == dtype
    ref = _reference(x, w, b)
    assert torch.allclose(out.double(), ref, rtol=tol, atol=tol * ref.abs().max().item())
    if dtype == torch.bfloat16:  # one rounding of a float32 sum, as torch's bf16 linear: within 1 ulp
        torch.testing.assert_close(out, F.linear(x, w, b), rtol=2 ** -7, atol=2 ** -7 * ref.abs().max().item())


def test_matrices_that_fit_in_cache_take_f_linear(monkeypatch):
    monkeypatch.setattr(cpu_linear, "MIN_WEIGHTS", 1 << 17)
    assert FusedLinear(torch.randn(64, 128))._kernel is None
    assert FusedLinear(torch.randn(256, 512))._kernel is not None


def test_strided_input_and_many_rows():
    w = torch.randn(24, 16)
    x = torch.randn(16, 3).t()  # rows not contiguous
    torch.testing.assert_close(linear(x, w), F.linear(x, w))
    many = torch.randn(SMALL_ROWS + 1, 16)  # prefill: F.linear itself
    assert torch.equal(linear(many, w), F.linear(many, w))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16])
def test_other_dtypes_take_f_linear(dtype):
    w, x = torch.randn(8, 8, dtype=dtype), torch.randn(1, 8, dtype=dtype)
    op = FusedLinear(w)
    assert op._kernel is None and torch.equal(op(x), F.linear(x, w))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("native", [False, True])
@pytest.mark.parametrize("with_bias, keep_float32", [(False, False), (True, False), (False, True)])
def test_many_16bit_rows_are_widened_where_the_cpu_would_emulate_them(monkeypatch, dtype, native, with_bias,
                                                                      keep_float32):
    """PyTorch's 16-bit GEMM on a CPU without 16-bit dot instructions ran ~7x slower than float32's:
    there, a prefill's rows meet float32 copies of a few weight rows at a time, rounded once."""
    monkeypatch.setattr(cpu_linear, "native_matmul", lambda d: native)
    monkeypatch.setattr(cpu_linear, "WIDEN_BYTES", 4 * 100 * 5)  # 5 weight rows a block: 8 blocks of 37
    g = torch.Generator().manual_seed(7)
    w = torch.randn(37, 100, generator=g).to(dtype)
    b = torch.randn(37, generator=g).to(dtype) if with_bias else None
    x = torch.randn(2, SMALL_ROWS, 100, generator=g).to(dtype)
    op = FusedLinear(w, b, keep_float32=keep_float32)
    calls = []
    real = F.linear
    monkeypatch.setattr(F, "linear", lambda *a: calls.append(a) or real(*a))
    out = op(x)
    assert op._widen is not native and bool(calls) is native
    assert out.shape == (2, SMALL_ROWS, 37) and out.dtype == (torch.float32 if keep_float32 else dtype)
    exact = _reference(x, w, b)  # float64: the float32 sums are within 1e-5 of it before rounding
    if native:
        assert torch.equal(out, real(x, w, b).to(out.dtype))
    elif keep_float32:
        torch.testing.assert_close(out.double(), exact, rtol=1e-5, atol=1e-5 * exact.abs().max().item())
    else:  # one rounding of the float32 sum: equal to the rounded float64 result but at near-ties
        assert (out != exact.to(dtype)).float().mean() < 0.01
        torch.testing.assert_close(out, exact.to(dtype), rtol=2 ** -7, atol=0)
    monkeypatch.setattr(op, "_widened", None)
    assert op(x[:, :3]).shape == (2, 3, 37)  # few rows never widen: decoding's kernels as before


def test_fused_projections_share_the_weights_and_give_the_same_tokens(default_lm):
    from triforce.config import SamplingParams, SpecParams
    from triforce.decoding.engine import Engine

    model = default_lm.model
    assert model.kernels == "fused"  # what loading gives
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    qkv, gate_up = attn.fused[0].weight, mlp.fused[0].weight
    # the checkpoint matrices are row slices of the fused ones: one copy of the weights
    assert attn.q_proj.weight.data_ptr() == qkv.data_ptr()
    assert attn.v_proj.weight.data_ptr() == qkv[-attn.v_proj.weight.shape[0]:].data_ptr()
    assert mlp.up_proj.weight.data_ptr() == gate_up[mlp.gate_proj.weight.shape[0]:].data_ptr()

    ids = default_lm.tokenizer("The history of the printing press begins", add_special_tokens=False).input_ids
    results = {}
    try:
        for kind in ("reference", "fused"):
            model.use_kernels(kind)
            engine = Engine(default_lm, SpecParams(method="ar"), len(ids) + 24)
            engine.set_sequence(ids)
            step = engine.full.cache.step(1)
            logits = model(torch.tensor([[ids[-1]]]), step.positions, step)
            engine.full.cache.rollback(step.start)
            results[kind] = (logits, engine.generate(24, SamplingParams()).tokens)
    finally:
        model.use_kernels("fused")
    torch.testing.assert_close(results["fused"][0], results["reference"][0], rtol=1e-4, atol=1e-4)
    assert results["fused"][1] == results["reference"][1]


def test_unknown_kernels_name_is_refused(default_lm):
    with pytest.raises(ValueError, match="unknown kernels"):
        default_lm.model.use_kernels("fast")


def test_logits_of_a_bfloat16_model_stay_float32():
    w = torch.randn(300, 512).to(torch.bfloat16)
    x = torch.randn(2, 512).to(torch.bfloat16)
    head = FusedLinear(w, keep_float32=True)
    out = head(x)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, F.linear(x.float(), w.float()), rtol=1e-5, atol=1e-4)
    assert head(torch.randn(SMALL_ROWS + 1, 512).to(torch.bfloat16)).dtype == torch.float32
    assert FusedLinear(w.double(), keep_float32=True)(x.double()).dtype == torch.float64  # never lowered
