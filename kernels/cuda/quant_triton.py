"""Linear layers over block-quantized weights (triforce.kernels.cuda.device_blocks) on a GPU, in
Triton: out = x W^T (+ bias) with W read as its blocks, never de-quantized into memory.

Why: a decoding step reads every weight once, so its time is the weight stream; a 4-bit block
is 0.625 bytes a weight against bfloat16's 2. quant_launch chooses per pass between the few-row
kernel (quant_gemv: decoding and the drafting tiers in 16-bit) and the dot kernel here, its tiles
and a split of the columns that keeps every SM loading. The dot kernel takes BLOCK_M input rows
and BLOCK_N weight rows, de-quantizes a step of blocks in registers (quant_steps), rounds the
weights to the activations' dtype (as the reference F.linear over the de-quantized weight does)
and accumulates tl.dot products in float32; float32 activations take IEEE products (no TF32)
and this kernel at every width, so a float32 row's result is the same in a decoding step and in
a verify pass (up to 64 rows; prefill takes taller tiles). Split sums are added by one more
kernel in a fixed order. The tiles are a first guess until a GPU measures them (`triforce bench
kernels --tiles`).
On CPU tensors the tests run the same kernels through Triton's interpreter (TRITON_INTERPRET=1).
float64 activations (exactness tests) take the reference path: de-quantize, then F.linear.
Importing this module needs `triton`."""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from triforce.kernels.cuda.device_blocks import BLOCK, DeviceBlocks
from triforce.kernels.cuda.quant_gemv import blocks_gemv_kernel, sum_splits_kernel
from triforce.kernels.cuda.quant_launch import (DEFAULT_TILES, NOMINAL_SMS, Launch, Tiles, kernel_for, measured_for,
                                                 measured_tiles, plan)
from triforce.kernels.cuda.quant_steps import byte_step, q4_step, q6_step

INTERPRETED_BLOCK_N = 256  # CPU tensors (Triton's interpreter, in tests): each program costs ~20 ms there
SUM_BLOCK = 1024


@triton.jit
def _blocks_dot_kernel(x_ptr, q_ptr, s_ptr, o_ptr, k_ptr, b_ptr, out_ptr, M, N, K, sx, so,
                       Q4: tl.constexpr, Q6: tl.constexpr, SHIFT: tl.constexpr, HAS_OFFSETS: tl.constexpr,
                       KQUANT: tl.constexpr,
                       HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, STEP: tl.constexpr, SPLIT: tl.constexpr):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    blocks = K // 32
    per = tl.cdiv(tl.cdiv(blocks, STEP), SPLIT) * STEP  # this program's columns (all unless SPLIT > 1)
    begin = tl.program_id(2) * per
    end = tl.minimum(begin + per, blocks)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for first in range(begin, end, STEP):
        if Q4:
            if Q6:
                lo, hi, col, k_ok = q6_step(q_ptr, s_ptr, o_ptr, k_ptr, offs_n, n_ok, first, blocks, K, BLOCK_N, STEP)
            else:
                lo, hi, col, k_ok = q4_step(q_ptr, s_ptr, o_ptr, k_ptr, offs_n, n_ok, first, blocks, K, SHIFT,
                                            HAS_OFFSETS, KQUANT, BLOCK_N, STEP)
            x_ok = m_ok[:, None] & k_ok[None, :]
            x_lo = tl.load(x_ptr + offs_m[:, None] * sx + col[None, :], mask=x_ok, other=0.0)
            x_hi = tl.load(x_ptr + offs_m[:, None] * sx + (col + 16)[None, :], mask=x_ok, other=0.0)
            if IEEE:
                acc += tl.dot(x_lo, tl.trans(lo), input_precision="ieee")
                acc += tl.dot(x_hi, tl.trans(hi), input_precision="ieee")
            else:
                acc += tl.dot(x_lo, tl.trans(lo.to(x_lo.dtype)))
                acc += tl.dot(x_hi, tl.trans(hi.to(x_hi.dtype)))
        else:
            w, col, k_ok = byte_step(q_ptr, s_ptr, offs_n, n_ok, first, K, GROUP, BLOCK_N, STEP)
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


def device_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a GPU (the split aims at programs per SM)."""
    if device.type != "cuda":
        return 1  # Triton's interpreter runs programs one by one: the fewest is the fastest
    return _sms(device.index if device.index is not None else torch.cuda.current_device())


_SMS: dict[int, int] = {}


def _sms(index: int) -> int:
    if index not in _SMS:
        _SMS[index] = getattr(torch.cuda.get_device_properties(index), "multi_processor_count", NOMINAL_SMS)
    return _SMS[index]


def launch_for(rows: torch.Tensor, w: DeviceBlocks, tiles: Tiles | None = None) -> Launch:
    """The launch of rows [m, cols] against w: `tiles`, else this card's measured ones, else the
    defaults (on CPU tensors, Triton's interpreter, wide tiles: fewer programs to interpret)."""
    m, float32 = rows.shape[0], rows.dtype == torch.float32
    if tiles is None and rows.device.type == "cuda":  # a card (or the tests' simulated one)
        tiles = measured_for(m, w.rows, w.cols, float32, w.kind, measured_tiles(capability(rows.device)))
    if tiles is None and not rows.is_cuda:
        default = DEFAULT_TILES[kernel_for(m, float32)]
        tiles = Tiles(INTERPRETED_BLOCK_N, default.step, default.warps, default.stages, 1)
    return plan(m, w.rows, w.cols, float32, device_sms(rows.device), tiles)


def capability(device: torch.device) -> str:
    """A GPU's compute capability as the tile table names it ("8.9")."""
    major, minor = torch.cuda.get_device_capability(device)
    return f"{major}.{minor}"


def blocks_linear(x: torch.Tensor, w: DeviceBlocks, bias: torch.Tensor | None = None,
                  out_dtype: torch.dtype | None = None, out: torch.Tensor | None = None,
                  tiles: Tiles | None = None) -> torch.Tensor:
    """x [..., cols] (float32, bfloat16 or float16) -> [..., rows] in out_dtype (x's by default);
    bias float32 [rows] or None; out: a contiguous [x's rows, rows] buffer to write (else new);
    tiles: instead of the planned ones (a benchmark's sweep)."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    m = rows.shape[0]
    if out is None:
        out = torch.empty(m, w.rows, dtype=out_dtype or x.dtype, device=x.device)
    if m:
        launch = launch_for(rows, w, tiles)
        split = launch.tiles.split
        unused = w.scales  # a real buffer behind pointers the kernel does not read (empty ones may be null)
        offsets = w.offsets if w.offsets.shape[1] else unused
        supers = w.supers if w.supers.shape[1] else unused
        sums = out if split == 1 else torch.empty(split, m, w.rows, dtype=torch.float32, device=x.device)
        bias_ptr = bias if bias is not None else unused
        shared = dict(Q4=w.nibbles, Q6=w.kind == "q6_k", SHIFT=w.bias, HAS_OFFSETS=w.kind in ("q4_1", "q4_k"),
                      KQUANT=w.kind == "q4_k", HAS_BIAS=bias is not None and split == 1,
                      GROUP=w.cols // w.scales.shape[1] if not w.nibbles else BLOCK, BLOCK_N=launch.tiles.block_n,
                      STEP=launch.tiles.step, SPLIT=split, num_warps=launch.tiles.warps,
                      num_stages=launch.tiles.stages)
        arguments = (rows, w.quants, w.scales, offsets, supers, bias_ptr, sums, m, w.rows, w.cols,
                     rows.stride(0), sums.stride(-2))
        if launch.kernel == "gemv":
            blocks_gemv_kernel[launch.grid](*arguments, ROWS=launch.block_m, **shared)
        else:
            _blocks_dot_kernel[launch.grid](*arguments, IEEE=rows.dtype == torch.float32, BLOCK_M=launch.block_m,
                                            **shared)
        if split > 1:  # the splits' sums added in a fixed order: a row's result does not depend on timing
            count = m * w.rows
            sum_splits_kernel[(triton.cdiv(count, SUM_BLOCK),)](sums, bias_ptr, out, count, w.rows, SPLIT=split,
                                                                HAS_BIAS=bias is not None, BLOCK=SUM_BLOCK)
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
