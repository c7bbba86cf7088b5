"""The Triton block kernels (triforce.kernels.cuda.quant_triton) against de-quantize-then-matmul:
on CUDA for real, on CPU tensors through Triton's interpreter (skipped without triton). Every
format, decoding and verify-sized passes and a prefill-sized one, with a bias, strided inputs,
every output element written; the device copy de-quantizes to the CPU blocks' bits."""
import pytest
import torch

from triforce.kernels.cpu.linear.block_formats import DEVICE_BYTES, FORMATS, BlockWeight
from triforce.kernels.cuda.device_blocks import DeviceBlocks

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# 16-bit activations: bfloat16 on a GPU; the interpreter computes bfloat16 wrongly (numpy has
# none), so on a CPU float16 stands for it (the same path through the kernel: rounded weights).
HALF = torch.bfloat16 if DEVICE.type == "cuda" else torch.float16


@pytest.fixture(scope="module")
def qt():
    pytest.importorskip("triton")
    from triforce.kernels.cuda import quant_triton
    return quant_triton


def blocks(kind: str, rows: int, cols: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    cpu = BlockWeight.quantize(kind, torch.randn(rows, cols, generator=g), k_factors=True)
    return cpu, DeviceBlocks.of(cpu, DEVICE), g


@pytest.mark.parametrize("kind", FORMATS)
def test_device_blocks_dequantize_to_the_cpu_blocks_bits(kind):
    cpu, dev, _ = blocks(kind, 40, 512, 1)
    assert torch.equal(dev.dequantized().cpu(), cpu.dequantized())
    index = torch.tensor([39, 0, 7, 7])
    assert torch.equal(dev.take_rows(index).cpu(), cpu.take_rows(index))
    stacked = DeviceBlocks.stack([dev, dev.part(slice(8, 24))])
    assert stacked.rows == 56 and torch.equal(stacked.dequantized().cpu()[40:], cpu.dequantized()[8:24])
    assert dev.nbytes == 40 * 512 // 32 * DEVICE_BYTES[kind] and dev.file_nbytes == cpu.file_nbytes


@pytest.mark.parametrize("kind", FORMATS)
@pytest.mark.parametrize("rows", [1, 5, 17, 70])
def test_kernel_equals_dequantize_then_matmul_in_float32(qt, kind, rows):
    cpu, dev, g = blocks(kind, 80, 768, rows)  # 80 weight rows: a partial last tile; 768: a partial last step
    wide = torch.randn(rows, 800, generator=g)
    x = wide[:, 16:784].to(DEVICE)             # strided rows, as a split of a fused projection passes them
    bias = torch.randn(80, generator=g).to(DEVICE)
    got = qt.blocks_linear(x, dev, bias)
    expected = x.double().cpu() @ cpu.dequantized().double().T + bias.double().cpu()
    assert got.dtype == torch.float32 and got.shape == (rows, 80)
    assert not got.isnan().any()
    torch.testing.assert_close(got.double().cpu(), expected, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("kind", FORMATS)
def test_a_rows_result_does_not_depend_on_its_pass(qt, kind):
    """float32 rows take one kernel at every width up to 64 (greedy equality with ar on a card
    rests on it); 16-bit rows are the same in every pass of the few-row kernel (1 to 4 rows)."""
    _, dev, g = blocks(kind, 64, 512, 3)
    x = torch.randn(17, 512, generator=g).to(DEVICE)
    pass_of_17 = qt.blocks_linear(x, dev)
    for i in (0, 5, 16):
        assert torch.equal(qt.blocks_linear(x[i:i + 1], dev)[0], pass_of_17[i])
    half = x.to(HALF)
    pass_of_4 = qt.blocks_linear(half[:4], dev, out_dtype=torch.float32)
    for i in range(4):
        assert torch.equal(qt.blocks_linear(half[i:i + 1], dev, out_dtype=torch.float32)[0], pass_of_4[i])
    assert torch.equal(qt.blocks_linear(half[1:3], dev, out_dtype=torch.float32), pass_of_4[1:3])


@pytest.mark.parametrize("kind", FORMATS)
@pytest.mark.parametrize("rows", [1, 3])
def test_the_few_row_kernel_equals_the_reference_in_16_bits(qt, kind, rows):
    """Decoding's kernel (no tl.dot): the weight rounded to the activations' dtype, products and
    sums in float32, with a bias, a split of the columns and strided rows."""
    cpu, dev, g = blocks(kind, 80, 768, 20 + rows)
    x = torch.randn(rows, 800, generator=g)[:, 16:784].to(DEVICE, HALF)
    bias = torch.randn(80, generator=g).to(DEVICE)
    expected = x.double().cpu() @ cpu.dequantized().to(HALF).double().T + bias.double().cpu()
    for tiles in (None, qt.Tiles.parse("16:2:4:1:3")):
        got = qt.blocks_linear(x, dev, bias, out_dtype=torch.float32, tiles=tiles)
        assert qt.launch_for(x, dev, tiles).kernel == "gemv"
        torch.testing.assert_close(got.double().cpu(), expected, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_16_bit_activations_round_the_weights_as_the_reference_does(qt, kind):
    cpu, dev, g = blocks(kind, 64, 512, 4)
    x = torch.randn(3, 512, generator=g).to(DEVICE, HALF)
    got = qt.TritonQuantLinear(dev)(x)
    logits = qt.TritonQuantLinear(dev, keep_float32=True)(x)
    expected = x.double().cpu() @ cpu.dequantized().to(HALF).double().T
    assert got.dtype == HALF and logits.dtype == torch.float32
    torch.testing.assert_close(logits.double().cpu(), expected, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(got.double().cpu(), expected, rtol=1e-2, atol=1e-2)


def test_every_output_element_is_written(qt):
    _, dev, g = blocks("q4_0", 70, 256, 5)
    x = torch.randn(3, 256, generator=g).to(DEVICE)
    first = qt.blocks_linear(x, dev)
    poisoned = torch.full_like(first, float("nan"))
    qt.blocks_linear(x, dev, out=poisoned)
    assert torch.equal(poisoned, first)


def test_float64_activations_take_the_reference_arithmetic(qt):
    cpu, dev, g = blocks("q4_k", 16, 256, 6)
    x = torch.randn(2, 256, generator=g, dtype=torch.float64).to(DEVICE)
    torch.testing.assert_close(qt.TritonQuantLinear(dev)(x).cpu(), x.cpu() @ cpu.dequantized().double().T,
                               rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kind", ["q4_k", "q4_1", "q8_0"])
@pytest.mark.parametrize("tiles", ["16:4:4:1:3", "32:2:8:3:2"])
def test_other_tiles_and_a_split_of_the_columns_compute_the_same(qt, kind, tiles):
    """What `triforce bench kernels --tiles` sweeps on a GPU: each split sums its range of steps,
    the splits added after in a fixed order; the result is the reference's, and a row's result
    is the same in a pass of one row and of seventeen."""
    cpu, dev, g = blocks(kind, 48, 1280, 11)   # 40 blocks: splits of unequal length (8 + 8 + 8 ... or 4 + 4 ...)
    x = torch.randn(17, 1280, generator=g).to(DEVICE)
    bias = torch.randn(48, generator=g).to(DEVICE)
    chosen = qt.Tiles.parse(tiles)
    got = qt.blocks_linear(x, dev, bias, tiles=chosen)
    expected = x.double().cpu() @ cpu.dequantized().double().T + bias.double().cpu()
    torch.testing.assert_close(got.double().cpu(), expected, rtol=1e-5, atol=1e-4)
    assert torch.equal(qt.blocks_linear(x[5:6], dev, bias, tiles=chosen), got[5:6])


def test_tiles_are_parsed_as_a_user_types_them(qt):
    assert str(qt.Tiles.parse("64:4")) == "64:4:4:3:auto" and str(qt.Tiles.parse("8:8:4:3:2")) == "8:8:4:3:2"
    assert qt.Tiles.parse("32:8:4:3:auto").split is None
    for bad in ("2:4", "48:4", "32:3", "32:4:3", "32:4:4:2:0", "32:4:4:2:1:1", "x", "32", "32:4:4:2:many"):
        with pytest.raises(ValueError):
            qt.Tiles.parse(bad)
    x = torch.randn(16, 256).to(DEVICE)
    with pytest.raises(ValueError, match="at least 16 rows"):  # a verify pass takes tl.dot
        qt.blocks_linear(x, blocks("q8_0", 16, 256, 1)[1], tiles=qt.Tiles.parse("8:8"))


@pytest.mark.parametrize("arch", ["llama3.1-8b", "qwen3-8b-128k", "qwen3-32b-128k", "gemma3-27b"])
def test_the_cards_launch_of_every_projection_equals_the_reference(qt, arch):
    """The tiles and column split a 4090 and an H200 take for each projection of the models a
    24 GB card runs (quant_launch.plan), on 24 of its weight rows (a partial last tile): the
    few-row kernel at one row, the dot kernel at 16, formats in turn (the interpreter is slow)."""
    from test_quant_launch import projections
    from triforce.model.quantized import _random_device_block

    launches = sorted({(k, m, qt.plan(m, n, k, False, sms).tiles) for n, k in projections(arch).values()
                       for m in (1, 16) for sms in (128, 132)}, key=str)
    for i, (k, m, tiles) in enumerate(launches):
        kind = ("q4_k", "q6_k", "q8_0")[i % 3]
        g = torch.Generator().manual_seed(i)
        dev = _random_device_block(kind, 24, k, torch.device("cpu"), g)
        x = torch.randn(m, k, generator=g).to(HALF)
        expected = x.double() @ dev.dequantized().to(HALF).double().T
        got = qt.blocks_linear(x.to(DEVICE), _on_device(dev), out_dtype=torch.float32, tiles=tiles)
        torch.testing.assert_close(got.double().cpu(), expected, rtol=1e-5, atol=1e-4, msg=f"{kind} {k} {m} {tiles}")


def _on_device(blocks: DeviceBlocks) -> DeviceBlocks:
    return DeviceBlocks(blocks.kind, blocks.rows, blocks.cols,
                        *(getattr(blocks, name).to(DEVICE) for name in ("quants", "scales", "offsets", "supers")))
