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
    assert torch.equal(DeviceBlocks.of(block, torch.device("cpu")).dequantized(), block.dequantized())


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
    nine = linear(x[:9])
    assert all(torch.equal(linear(x[i:i + 1])[0], nine[i]) for i in range(9))


def test_q6_k_triton_kernel_equals_dequantize_then_matmul():
    pytest.importorskip("triton")
    from triforce.kernels.cuda.quant_triton import blocks_linear

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    block = BlockWeight.from_raw("q6_k", random_q6_k(48, 512, 2), 48, 512)
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(2))
    got = blocks_linear(x.to(device), DeviceBlocks.of(block, device))
    expected = x.double() @ block.dequantized().double().T
    assert ((got.double().cpu() - expected).norm() / expected.norm()).item() < 1e-6
