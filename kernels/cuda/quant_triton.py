"""Linear layers over block-quantized weights (triforce.kernels.cuda.device_blocks) on a GPU, in
Triton: out = x W^T (+ bias) with W read as its blocks, never de-quantized into memory.

Why: a decoding step reads every weight once, so its time is the weight stream; a 4-bit block
is 0.625 bytes a weight against bfloat16's 2. Each program takes BLOCK_M input rows and BLOCK_N
weight rows and walks the columns BLOCKS_PER_STEP blocks at a time: it loads the packed bytes,
the blocks' scales (and offsets; Q4_K's sc and m times its super-block's d and dmin), unpacks
the nibbles in registers (byte j of a block holds weight j in its low nibble and weight j + 16
in its high one, so the two halves meet the inputs at columns j and j + 16), scales them in
float32 as BlockWeight.dequantized does, rounds them to the activations' dtype (as the reference
F.linear over the de-quantized weight does) and accumulates tl.dot products in float32. float32
activations take IEEE products (no TF32).

The tile shapes do not depend on the number of rows, so a row's result is the same in a
decoding step and in a verify pass (up to 64 rows; longer passes, prefill, take taller tiles).
`Tiles` sets the weight rows per program, the blocks per step, the warps, the pipeline stages and
a split of the columns (SPLIT programs per tile, each over a range of steps, their float32 sums
added in a fixed order after): untuned until a GPU measures them (`triforce bench kernels
--tiles`); the defaults are the first guess's.
On CPU tensors the tests run the same kernel through Triton's interpreter (TRITON_INTERPRET=1).
float64 activations (exactness tests) take the reference path: de-quantize, then F.linear.
Importing this module needs `triton`."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from triforce.kernels.cuda.device_blocks import BLOCK, DeviceBlocks

BLOCK_N = 32            # weight rows per program: a 4096-row matrix spreads over 128 programs
INTERPRETED_BLOCK_N = 256  # CPU tensors (Triton's interpreter, in tests): each program costs ~20 ms there
BLOCKS_PER_STEP = 8     # 256 columns a step: 128 contiguous bytes of each 4-bit row
SHORT_M, TALL_M = 16, 64
SHORT_PASS = 64         # up to this many rows the short tiles serve (decoding, verify passes)
# rows of the passes that compile every specialisation a run takes before its first token: Triton
# specialises integer arguments equal to 1 or divisible by 16, and the tile height follows SHORT_PASS
WARM_ROWS = (1, 3, 16, SHORT_PASS + 1, 2 * SHORT_PASS)


@dataclass(frozen=True)
class Tiles:
    block_n: int = BLOCK_N          # weight rows per program (at least 16: tl.dot's width)
    step: int = BLOCKS_PER_STEP     # 32-weight blocks per step of the column loop
    warps: int = 4                  # (4 and 3: Triton's defaults, which the kernel ran with before)
    stages: int = 3                 # software pipelining of the column loop
    split: int = 1                  # programs per tile along the columns

    @classmethod
    def parse(cls, text: str) -> "Tiles":
        """'BLOCK_N:STEP:WARPS:STAGES:SPLIT' (trailing fields may be left out)."""
        values = [int(v) for v in text.split(":")]
        powers = values[:3]  # BLOCK_N, STEP and WARPS: Triton's shapes and warps are powers of two
        if not 1 <= len(values) <= 5 or min(values) < 1 or values[0] < 16 or any(v & (v - 1) for v in powers):
            raise ValueError(f"tiles '{text}': BLOCK_N:STEP:WARPS:STAGES:SPLIT, BLOCK_N a power of two >= 16, "
                             "STEP and WARPS powers of two")
        return cls(*values)

    def __str__(self) -> str:
        return f"{self.block_n}:{self.step}:{self.warps}:{self.stages}:{self.split}"


TILES = Tiles()


@triton.jit
def _spread(factors, BLOCK_N: tl.constexpr, COUNT: tl.constexpr, WIDTH: tl.constexpr):
    """[BLOCK_N, COUNT] factors (one per block or scale group) -> [BLOCK_N, COUNT * WIDTH], each
    repeated over the WIDTH bytes or columns it scales."""
    return tl.reshape(tl.broadcast_to(factors[:, :, None], (BLOCK_N, COUNT, WIDTH)), (BLOCK_N, COUNT * WIDTH))


@triton.jit
def _blocks_linear_kernel(x_ptr, q_ptr, s_ptr, o_ptr, k_ptr, b_ptr, out_ptr, M, N, K, sx, so,
                          Q4: tl.constexpr, SHIFT: tl.constexpr, HAS_OFFSETS: tl.constexpr, KQUANT: tl.constexpr,
                          HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, STEP: tl.constexpr, SPLIT: tl.constexpr):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    blocks = K // 32
    # this program's steps of the columns (all of them unless SPLIT > 1)
    per = tl.cdiv(tl.cdiv(blocks, STEP), SPLIT) * STEP
    begin = tl.program_id(2) * per
    end = tl.minimum(begin + per, blocks)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if Q4:
        j = tl.arange(0, STEP * 16)                  # the step's bytes of a row
        b = tl.arange(0, STEP)                       # the step's blocks
        for first in range(begin, end, STEP):
            blk = first + j // 16
            k_ok = blk < blocks
            w_ok = n_ok[:, None] & k_ok[None, :]
            byte = tl.load(q_ptr + offs_n[:, None] * (K // 2) + (first * 16 + j)[None, :], mask=w_ok, other=0)
            # a block's factors are loaded once, then spread over its 16 bytes in registers
            b_ok = n_ok[:, None] & (first + b < blocks)[None, :]
            d = tl.load(s_ptr + offs_n[:, None] * blocks + (first + b)[None, :], mask=b_ok, other=0).to(tl.float32)
            if KQUANT:  # Q4_K: d256 sc and -(dmin256 m), the products BlockWeight holds
                sup = k_ptr + offs_n[:, None] * (blocks // 8 * 2) + ((first + b) // 8 * 2)[None, :]
                d = tl.load(sup, mask=b_ok, other=0.0) * d
            d = _spread(d, BLOCK_N, STEP, 16)
            lo = d * ((byte & 15).to(tl.float32) - SHIFT)
            hi = d * ((byte >> 4).to(tl.float32) - SHIFT)
            if HAS_OFFSETS:
                m = tl.load(o_ptr + offs_n[:, None] * blocks + (first + b)[None, :], mask=b_ok, other=0).to(tl.float32)
                if KQUANT:
                    m = -(tl.load(sup + 1, mask=b_ok, other=0.0) * m)
                m = _spread(m, BLOCK_N, STEP, 16)
                lo += m
                hi += m
            col = blk * 32 + j % 16
            x_ok = m_ok[:, None] & k_ok[None, :]
            x_lo = tl.load(x_ptr + offs_m[:, None] * sx + col[None, :], mask=x_ok, other=0.0)
            x_hi = tl.load(x_ptr + offs_m[:, None] * sx + (col + 16)[None, :], mask=x_ok, other=0.0)
            if IEEE:
                acc += tl.dot(x_lo, tl.trans(lo), input_precision="ieee")
                acc += tl.dot(x_hi, tl.trans(hi), input_precision="ieee")
            else:
                acc += tl.dot(x_lo, tl.trans(lo.to(x_lo.dtype)))
                acc += tl.dot(x_hi, tl.trans(hi.to(x_hi.dtype)))
    else:  # signed bytes: Q8_0's scale per 32, Q6_K's per GROUP = 16
        c = tl.arange(0, STEP * 32)                   # the step's columns
        for first in range(begin, end, STEP):
            col = first * 32 + c
            k_ok = col < K
            w_ok = n_ok[:, None] & k_ok[None, :]
            q = tl.load(q_ptr + offs_n[:, None] * K + col[None, :], mask=w_ok, other=0)
            g = first * 32 // GROUP + tl.arange(0, STEP * 32 // GROUP)  # the step's scale groups, once each
            d = tl.load(s_ptr + offs_n[:, None] * (K // GROUP) + g[None, :], mask=n_ok[:, None] & (g < K // GROUP)[None, :],
                        other=0).to(tl.float32)
            d = _spread(d, BLOCK_N, STEP * 32 // GROUP, GROUP)
            w = d * q.to(tl.float32)
            xs = tl.load(x_ptr + offs_m[:, None] * sx + col[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            if IEEE:
                acc += tl.dot(xs, tl.trans(w), input_precision="ieee")
            else:
                acc += tl.dot(xs, tl.trans(w.to(xs.dtype)))
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0)[None, :]
    out_ptr += tl.program_id(2) * M * so             # a split's own [M, N] of the float32 sums
    tl.store(out_ptr + offs_m[:, None] * so + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def blocks_linear(x: torch.Tensor, w: DeviceBlocks, bias: torch.Tensor | None = None,
                  out_dtype: torch.dtype | None = None, out: torch.Tensor | None = None,
                  tiles: Tiles | None = None) -> torch.Tensor:
    """x [..., cols] (float32, bfloat16 or float16) -> [..., rows] in out_dtype (x's by default);
    bias float32 [rows] or None; out: a contiguous [x's rows, rows] buffer to write (else new);
    tiles: instead of TILES (a benchmark's sweep)."""
    tiles = tiles or TILES
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    m = rows.shape[0]
    if out is None:
        out = torch.empty(m, w.rows, dtype=out_dtype or x.dtype, device=x.device)
    if m:
        block_m = SHORT_M if m <= SHORT_PASS else TALL_M
        block_n = tiles.block_n if x.is_cuda else INTERPRETED_BLOCK_N  # the real device: compiled or interpreted
        split = min(tiles.split, triton.cdiv(w.cols // BLOCK, tiles.step))
        grid = (triton.cdiv(m, block_m), triton.cdiv(w.rows, block_n), split)
        unused = w.scales  # a real buffer behind pointers the kernel does not read (empty ones may be null)
        offsets = w.offsets if w.offsets.shape[1] else unused
        supers = w.supers if w.kind == "q4_k" else unused
        sums = out if split == 1 else torch.empty(split, m, w.rows, dtype=torch.float32, device=x.device)
        _blocks_linear_kernel[grid](rows, w.quants, w.scales, offsets, supers,
                                    bias if bias is not None else unused, sums, m, w.rows, w.cols,
                                    rows.stride(0), sums.stride(-2), Q4=w.q4, SHIFT=w.bias,
                                    HAS_OFFSETS=w.offsets.shape[1] > 0, KQUANT=w.kind == "q4_k",
                                    HAS_BIAS=bias is not None and split == 1, IEEE=rows.dtype == torch.float32,
                                    GROUP=w.cols // w.scales.shape[1] if not w.q4 else BLOCK,
                                    BLOCK_M=block_m, BLOCK_N=block_n, STEP=tiles.step, SPLIT=split,
                                    num_warps=tiles.warps, num_stages=tiles.stages)
        if split > 1:  # the splits' sums added in a fixed order: a row's result does not depend on its pass
            total = sums[0]
            for part in sums[1:]:
                total += part
            if bias is not None:
                total += bias
            out.copy_(total)
    return out.view(*x.shape[:-1], w.rows)


class TritonQuantLinear:
    """A linear layer over DeviceBlocks (and a bias), called per pass as QuantLinear is on the CPU.
    keep_float32: results stay float32 whatever the activations' dtype (a model's logits)."""

    def __init__(self, block: DeviceBlocks, bias: torch.Tensor | None = None, keep_float32: bool = False):
        if block.cols % BLOCK:
            raise ValueError(f"block weights need whole {BLOCK}-weight blocks per row")
        self.block, self.bias = block, None if bias is None else bias.detach()
        self.keep_float32 = keep_float32
        self.out_features, self.in_features = block.rows, block.cols
        self._bias32 = None if bias is None else self.bias.to(torch.float32)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float64:  # exactness tests: the reference arithmetic
            bias = None if self.bias is None else self.bias.to(x.dtype)
            return F.linear(x, self.block.dequantized().to(x.dtype), bias)
        out_dtype = torch.float32 if self.keep_float32 else x.dtype
        return blocks_linear(x, self.block, self._bias32, out_dtype)
