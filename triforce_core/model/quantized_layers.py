"""The modules a block-quantized model is made of (triforce.model.quantized makes them): a linear
layer and an embedding over a BlockWeight (numpy arrays, for the CPU's numba kernels) or a
DeviceBlocks (torch tensors on a GPU, for the Triton kernels), and the stacking of projections for
the fused kernels."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from triforce.kernels.cpu.linear.block_formats import BlockWeight
from triforce.kernels.cpu.linear.blocks import QuantLinear


class QuantizedLinear(nn.Module):
    """forward is the reference path: the whole weight de-quantized, then F.linear."""

    def __init__(self, block: BlockWeight, bias: torch.Tensor | None):
        super().__init__()
        self.block = block
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.in_features, self.out_features = block.cols, block.rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.block.dequantized().to(x.dtype), bias)


class QuantizedEmbedding(nn.Module):
    """Looked-up rows de-quantized (a tied model shares its blocks with the head)."""

    def __init__(self, block: BlockWeight, dtype: torch.dtype):
        super().__init__()
        self.block, self.dtype = block, dtype

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.block.take_rows(tokens.reshape(-1)).to(self.dtype).view(*tokens.shape, self.block.cols)


class JoinedOutputs(nn.Module):
    """Projections of one input whose weights cannot share one matrix (blocks of different formats,
    or blocks beside floats, as a GGUF file may mix them): each runs alone, their outputs joined."""

    def __init__(self, parts: list):
        super().__init__()
        self.parts = parts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(x) for part in self.parts], dim=-1)


def one_block_format(linears) -> bool:
    """Whether the linears are all block-quantized in one format (stacked_blocks takes them)."""
    return all(isinstance(m, QuantizedLinear) for m in linears) and len({m.block.kind for m in linears}) == 1


def block_linear(block, bias: torch.Tensor | None = None, keep_float32: bool = False):
    """The kernels' linear layer over `block`: QuantLinear (numba) for a BlockWeight,
    TritonQuantLinear for DeviceBlocks."""
    if isinstance(block, BlockWeight):
        return QuantLinear(block, bias, keep_float32)
    from triforce.kernels.cuda.quant_triton import TritonQuantLinear  # needs triton: only for a GPU's blocks
    return TritonQuantLinear(block, bias, keep_float32)


def stacked_blocks(linears):
    """One block matrix holding the linears' blocks one above the other, each linear's block
    re-pointed at its rows of it (views), so the blocks are not kept twice."""
    stacked = type(linears[0].block).stack([m.block for m in linears])
    biases = [m.bias for m in linears]
    row = 0
    for m in linears:
        rows = m.block.rows
        m.block = stacked.part(slice(row, row + rows))
        row += rows
    bias = None if biases[0] is None else torch.cat([b.detach() for b in biases])
    return block_linear(stacked, bias)
