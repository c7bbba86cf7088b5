"""Q6_K tensors (what llama.cpp's Q4_K_M and Q5_K_M files keep for the output layer and half of
attn_v and ffn_down) run as blocks: read from random Q6_K bytes, they de-quantize to the gguf
package's bits, and the CPU's numba kernels (vectors and plain loops) and the Triton kernels
(CPU tensors through the interpreter) equal de-quantize-then-matmul."""
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from triforce.kernels.cpu.linear.block_formats import BlockWeight, format_of
from triforce.kernels.cpu.linear.blocks import QuantLinear
from triforce.kernels.cuda.device_blocks import DeviceBlocks


def random_q6_k(rows: int, cols: int, seed: int) -> np.ndarray:
    """Random Q6_K bytes: any nibbles, bit pairs and int8 scales; a finite float16 d per 256."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, cols // 256 * 210), dtype=np.uint8)
    d = (rng.normal(size=(rows * cols // 256, 1)) * 1e-3).astype(np.float16)
    raw.reshape(-1, 210)[:, 208:210] = d.view(np.uint8)
    return raw


def test_q6_k_blocks_dequantize_as_the_gguf_package():
    raw = random_q6_k(24, 768, 0)
    block = BlockWeight.from_raw("q6_k", raw, 24, 768)
    assert format_of(GGMLQuantizationType.Q6_K) == "q6_k" and block.group == 16
    assert torch.equal(block.dequantized(), torch.from_numpy(dequantize(raw, GGMLQuantizationType.Q6_K)))
    assert block.nbytes == 24 * 768 * 40 // 32 and block.file_nbytes == raw.nbytes
    with pytest.raises(ValueError, match="k_factors"):
        DeviceBlocks.of(block, torch.device("cpu"))
    held = BlockWeight.from_raw("q6_k", raw, 24, 768, k_factors=True)
    device = DeviceBlocks.of(held.permute_rows(np.arange(23, -1, -1)), torch.device("cpu"))
    assert torch.equal(device.dequantized(), block.dequantized().flip(0))
    assert torch.equal(device.take_rows(torch.tensor([3, 3, 0])), block.dequantized()[[20, 20, 23]])
    assert torch.equal(torch.from_numpy(block.quants).flip(0), device.quant_values())
    # the file's bytes, less its float16 d widened: 26.5 bytes per 32 weights on a card, not 40
    assert device.nbytes == 24 * 768 * 26.5 / 32


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_q6_k_kernels_equal_dequantize_then_matmul(dtype):
    block = BlockWeight.from_raw("q6_k", random_q6_k(40, 512, 1), 40, 512)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(40, 512, generator=g, dtype=dtype)
    linear = QuantLinear(block)
    reference = block.dequantized().to(dtype)
    for rows in (1, 5, 16, 40):  # the vector kernel (float32), plain loops (float64), de-quantized tiles past 16
        got, expected = linear(x[:rows]), x[:rows].double() @ reference.double().T
        assert got.dtype == dtype
        assert ((got.double() - expected).norm() / expected.norm()).item() < (1e-6 if dtype == torch.float32 else 1e-14)
    for rows in (2, 3, 9):  # rows in groups of 4, then 1 to 3: each as alone
        together = linear(x[:rows])
        assert all(torch.equal(linear(x[i:i + 1])[0], together[i]) for i in range(rows))


def test_q6_k_triton_kernel_equals_dequantize_then_matmul():
    pytest.importorskip("triton")
    from triforce.kernels.cuda.quant_triton import blocks_linear

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    block = BlockWeight.from_raw("q6_k", random_q6_k(48, 512, 2), 48, 512, k_factors=True)
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(2))
    expected = x.double() @ block.dequantized().double().T
    for rows in (1, 5):  # the dot kernel in float32; the few-row kernel in 16 bits below
        got = blocks_linear(x[:rows].to(device), DeviceBlocks.of(block, device))
        assert ((got.double().cpu() - expected[:rows]).norm() / expected[:rows].norm()).item() < 1e-6
    half = torch.bfloat16 if device.type == "cuda" else torch.float16
    got = blocks_linear(x[:2].to(device, half), DeviceBlocks.of(block, device), out_dtype=torch.float32)
    expected = x[:2].to(half).double() @ block.dequantized().to(half).double().T
    torch.testing.assert_close(got.double().cpu(), expected, rtol=1e-5, atol=1e-4)
