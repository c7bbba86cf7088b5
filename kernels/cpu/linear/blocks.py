"""Linear layers over block-quantized weights (triforce.kernels.cpu.linear.block_formats) on the CPU.

Why: a decoding step reads every weight once, so on a CPU its time is the weight stream; a 4-bit
block is 0.625 bytes a weight against float32's 4. Up to SMALL_ROWS input rows (decoding, verify
passes) a numba kernel reads each weight row's blocks for every input row, split over the cores:
per block it sums q x over the block's 32 inputs and scales once (d (q . x) + m sum(x)); float32
inputs on CPUs with FMA take explicit vectors (triforce.kernels.cpu.linear.block_dot: 16 lanes with
AVX-512, else 8), others (float64, in tests) plain loops. A row's result does not depend on how many rows the pass has, so every
method's passes see the same numbers. Longer passes (prefill) de-quantize
WIDEN_BYTES of weight rows at a time into a float GEMM."""
from __future__ import annotations

import numba
import numpy as np
import torch
import torch.nn.functional as F
from numba import prange, types
from numba.extending import overload

from triforce.kernels.cpu.linear.block_dot import WIDE_BLOCKS, block_total, q4_rows, q8_rows, q8_rows16
from triforce.kernels.cpu.linear.block_formats import BLOCK, BYTE_QUANTS, Q4_BIAS, BlockWeight
from triforce.kernels.cpu.linear.dense import SMALL_ROWS, WIDEN_BYTES, small_rows_linear
from triforce.kernels.cpu.row_jobs import job_span, row_jobs
from triforce.kernels.cpu.simd.bf16_dot import HAS_BF16_DOT
from triforce.kernels.cpu.simd.bf16_dot import zeros as zeros16
from triforce.kernels.cpu.simd.f32_dot import HAS_F32_FMA, fma_at, zeros8

# a prefill's bfloat16 rows multiply bfloat16 weight tiles where the CPU has BF16 dot products: its
# GEMM runs ~4x float32's there (946 against 215 GFLOP/s, a 1024x576x1536 product on Zen 4)
BF16_GEMM = HAS_BF16_DOT



@numba.njit(cache=True)
def block_sums(x):
    """[rows, blocks]: each block's sum of inputs, in order (a 4-bit bias or offset multiplies it)."""
    rows, width = x.shape
    sums = np.empty((rows, width // BLOCK), x.dtype)
    for i in range(rows):
        for b in range(width // BLOCK):
            s = x[i, 0] * 0
            for j in range(b * BLOCK, (b + 1) * BLOCK):
                s += x[i, j]
            sums[i, b] = s
    return sums


@numba.njit(inline="always")
def _q4_row(x, quants, scales, offsets, r, bias, sums, has_offsets, zero, out):
    """Output column r of every input row over weight row r's 4-bit blocks; zero: an empty
    accumulator of the lanes to use (8 or 16). Rows go four at a time, then the 1 to 3 left in
    one group: a group shares each block's unpacking (2 rows alone cost 2.0x one, bench/RESULTS.md
    "Rows that share a block's unpacking") and each of its rows sums as alone."""
    rows = x.shape[0]
    i = 0
    while i + 4 <= rows:
        _q4_group(x, quants, scales, offsets, r, bias, sums, has_offsets, (zero, zero, zero, zero), i, out)
        i += 4
    if rows - i == 3:
        _q4_group(x, quants, scales, offsets, r, bias, sums, has_offsets, (zero, zero, zero), i, out)
    elif rows - i == 2:
        _q4_group(x, quants, scales, offsets, r, bias, sums, has_offsets, (zero, zero), i, out)
    elif rows - i == 1:
        _q4_group(x, quants, scales, offsets, r, bias, sums, has_offsets, (zero,), i, out)


@numba.njit(inline="always")
def _q4_group(x, quants, scales, offsets, r, bias, sums, has_offsets, accs, first, out):
    """Output column r of input rows first .. first + len(accs) (accs: that many empty accumulators).
    Flat indices, no row views (block_dot says why)."""
    width = x.shape[1]
    q = r * quants.shape[1]
    for b in range(scales.shape[1]):
        accs = q4_rows(accs, quants, q + b * (BLOCK // 2), x, first * width + b * BLOCK, width, scales[r, b])
    i = first
    for acc in accs:
        out[i, r] = block_total(acc) + _rest(scales, offsets, r, bias, sums, i, has_offsets)
        i += 1


@numba.njit(parallel=True, cache=True)
def linear_q4_fma(x, quants, scales, offsets, bias, out):
    """linear_blocks of 4-bit blocks for float32 x on 8-lane vectors (triforce.kernels.cpu.linear.block_dot);
    HAS_F32_FMA only."""
    n = scales.shape[0]
    sums = block_sums(x)
    for job in prange(row_jobs(n)):
        start, stop = job_span(job, n)
        for r in range(start, stop):
            _q4_row(x, quants, scales, offsets, r, bias, sums, offsets.shape[1] > 0, zeros8(), out)


@numba.njit(parallel=True, cache=True)
def linear_q4_wide(x, quants, scales, offsets, bias, out):
    """linear_q4_fma on 16-lane vectors; WIDE_BLOCKS only."""
    n = scales.shape[0]
    sums = block_sums(x)
    for job in prange(row_jobs(n)):
        start, stop = job_span(job, n)
        for r in range(start, stop):
            _q4_row(x, quants, scales, offsets, r, bias, sums, offsets.shape[1] > 0, zeros16(), out)


@numba.njit(inline="always")
def _rest(scales, offsets, r, bias, sums, i, has_offsets):
    """The blocks' offset and bias terms of weight row r and input row i: sum over b of
    (m_b - d_b bias) sum(x_b), as m . sums - bias (d . sums) (a format has offsets or a bias,
    never both) on vectors: a scalar loop's chain of additions cost these kernels ~40% of their
    time (bench/RESULTS.md, "16 lanes")."""
    rest = np.float32(0.0)
    if has_offsets:
        rest += _short_dot(offsets, r, sums, i)
    if bias != 0:
        rest -= bias * _short_dot(scales, r, sums, i)
    return rest


@numba.njit(inline="always")
def _short_dot(a, ra, b, rb):
    """a[ra] . b[rb] for two float32 matrices of one width: 8 lanes at a time, then the tail in order."""
    n = a.shape[1]
    acc = zeros8()
    k = 0
    while k + 8 <= n:
        acc = fma_at(acc, a, ra * n + k, b, rb * n + k)
        k += 8
    total = block_total(acc)
    while k < n:
        total += a[ra, k] * b[rb, k]
        k += 1
    return total


@numba.njit(inline="always")
def _q8_row(x, quants, scales, zero, r, out):
    """Output column r of every input row over weight row r's signed-byte blocks (Q8_0's 32 or
    Q6_K's 16 weights a scale); zero: an empty accumulator of the lanes to use. Rows in groups as
    _q4_row's."""
    rows = x.shape[0]
    i = 0
    while i + 4 <= rows:
        _q8_group(x, quants, scales, r, (zero, zero, zero, zero), i, out)
        i += 4
    if rows - i == 3:
        _q8_group(x, quants, scales, r, (zero, zero, zero), i, out)
    elif rows - i == 2:
        _q8_group(x, quants, scales, r, (zero, zero), i, out)
    elif rows - i == 1:
        _q8_group(x, quants, scales, r, (zero,), i, out)


@numba.njit(inline="always")
def _q8_group(x, quants, scales, r, accs, first, out):
    """Output column r of input rows first .. first + len(accs), each block's bytes converted once."""
    width = x.shape[1]
    blocks = scales.shape[1]
    group = quants.shape[1] // blocks
    q = r * quants.shape[1]
    if group == BLOCK:
        for b in range(blocks):
            accs = q8_rows(accs, quants, q + b * BLOCK, x, first * width + b * BLOCK, width, scales[r, b])
    else:
        for b in range(blocks):
            accs = q8_rows16(accs, quants, q + b * 16, x, first * width + b * 16, width, scales[r, b])
    i = first
    for acc in accs:
        out[i, r] = block_total(acc)
        i += 1


@numba.njit(parallel=True, cache=True)
def linear_q8_fma(x, quants, scales, out):
    """linear_blocks of signed-byte blocks for float32 x on 8-lane vectors; HAS_F32_FMA only."""
    n = scales.shape[0]
    for job in prange(row_jobs(n)):
        start, stop = job_span(job, n)
        for r in range(start, stop):
            _q8_row(x, quants, scales, zeros8(), r, out)


@numba.njit(parallel=True, cache=True)
def linear_q8_wide(x, quants, scales, out):
    """linear_q8_fma on 16-lane vectors; WIDE_BLOCKS only."""
    n = scales.shape[0]
    for job in prange(row_jobs(n)):
        start, stop = job_span(job, n)
        for r in range(start, stop):
            _q8_row(x, quants, scales, zeros16(), r, out)


@numba.njit(parallel=True, fastmath=True, cache=True)
def linear_blocks(x, quants, scales, offsets, bias, kind4, out):
    """The plain loops (float64 inputs in tests, CPUs without FMA): out[i, r] = sum over blocks b
    of scales[r, b] (q . x[i, b] - bias sum(x[i, b])) + offsets[r, b] sum(x[i, b]). kind4: 4-bit
    blocks (byte j holds weight j in its low nibble, j + 16 in its high one; offsets [n, 0]: none),
    else signed bytes (Q8_0's blocks of 32, Q6_K's of 16: no bias or offsets)."""
    rows = x.shape[0]
    n, blocks = scales.shape
    sums = block_sums(x)
    has_offsets = offsets.shape[1] > 0
    half = BLOCK // 2
    group = x.shape[1] // blocks
    for job in prange(row_jobs(n)):
        start, stop = job_span(job, n)
        for r in range(start, stop):
            for i in range(rows):
                acc = x[i, 0] * 0
                for b in range(blocks):
                    dot = x[i, 0] * 0
                    base = b * BLOCK
                    if kind4:
                        for j in range(half):
                            byte = quants[r, b * half + j]
                            dot += np.float32(byte & 15) * x[i, base + j] + np.float32(byte >> 4) * x[i, base + half + j]
                        acc += scales[r, b] * (dot - bias * sums[i, b])
                        if has_offsets:
                            acc += offsets[r, b] * sums[i, b]
                    else:  # signed bytes: blocks of `group` (32, or Q6_K's 16)
                        for j in range(b * group, (b + 1) * group):
                            dot += np.float32(quants[r, j]) * x[i, j]
                        acc += scales[r, b] * dot
                out[i, r] = acc


@numba.njit(parallel=True, cache=True)
def dequantize_rows(quants, scales, offsets, kind4, bias, first, out):
    """out [m, cols] float32 = weight rows first .. first + m; kind4: 4-bit blocks (else signed
    bytes: Q8_0's blocks of 32 or Q6_K's of 16)."""
    m, cols = out.shape
    blocks = scales.shape[1]
    group = cols // blocks
    half = BLOCK // 2
    has_offsets = offsets.shape[1] > 0
    for k in prange(m):
        r = first + k
        for b in range(blocks):
            d = scales[r, b]
            base = b * BLOCK
            if kind4:
                m_b = offsets[r, b] if has_offsets else np.float32(0.0)
                for j in range(half):
                    byte = quants[r, b * half + j]
                    out[k, base + j] = d * (np.float32(byte & 15) - bias) + m_b
                    out[k, base + half + j] = d * (np.float32(byte >> 4) - bias) + m_b
            else:
                for j in range(b * group, (b + 1) * group):
                    out[k, j] = d * np.float32(quants[r, j])


def project(x, w, out):
    raise NotImplementedError("numba only: see the overload")


@overload(project)
def _project_for(x, w, out):
    """out = x . w.T for the fused layer (triforce.kernels.cpu.layer), chosen when numba
    compiles: a float32 or bfloat16 weight array takes small_rows_linear, a QuantLinear's
    kernel_args tuple its block kernel (4-bit: quants, scales, offsets, bias; Q8_0: quants, scales)."""
    if isinstance(w, types.Array):
        return lambda x, w, out: small_rows_linear(x, w, out)
    q4, q8 = (linear_q4_wide, linear_q8_wide) if WIDE_BLOCKS else (linear_q4_fma, linear_q8_fma)
    if isinstance(w, types.BaseTuple) and len(w) == 4:
        return lambda x, w, out: q4(x, w[0], w[1], w[2], w[3], out)
    if isinstance(w, types.BaseTuple) and len(w) == 2:
        return lambda x, w, out: q8(x, w[0], w[1], out)
    return None


class QuantLinear:
    """A linear layer over a BlockWeight (and a float bias), called per pass like FusedLinear.
    keep_float32: results stay float32 whatever the activations' dtype (a model's logits)."""

    def __init__(self, block: BlockWeight, bias: torch.Tensor | None = None, keep_float32: bool = False):
        self.block, self.bias = block, None if bias is None else bias.detach()
        self.keep_float32 = keep_float32
        self.out_features, self.in_features = block.rows, block.cols
        self._bias = np.float32(Q4_BIAS.get(block.kind, 0.0))
        self._bias32 = None if bias is None else self.bias.to(torch.float32)
        self.lanes = 16 if WIDE_BLOCKS else 8  # of the block kernels' vectors (`triforce bench kernels --lanes`)

    @property
    def kernel_args(self) -> tuple:
        """What `project` takes for this weight inside a numba function."""
        b = self.block
        return (b.quants, b.scales) if b.kind in BYTE_QUANTS else (b.quants, b.scales, b.offsets, self._bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        work = torch.float64 if x.dtype == torch.float64 else torch.float32
        if rows.shape[0] > SMALL_ROWS and x.dtype == torch.bfloat16 and BF16_GEMM and not self.keep_float32:
            out = self._widened(rows.contiguous())  # bfloat16 GEMMs, weights rounded as --quantize none's
            if self.bias is not None:
                out += self.bias.to(torch.bfloat16)
            return out.view(*x.shape[:-1], self.out_features)
        rows = rows.to(work).contiguous()
        if rows.shape[0] <= SMALL_ROWS:
            out = self._small(rows)
        else:
            out = self._widened(rows)
        if self.bias is not None:
            out += self.bias.to(work)
        out = out.view(*x.shape[:-1], self.out_features)
        return out if self.keep_float32 and work == torch.float32 else out.to(x.dtype)

    def _small(self, rows: torch.Tensor) -> torch.Tensor:
        b = self.block
        out = torch.empty(rows.shape[0], b.rows, dtype=rows.dtype)
        x, o = rows.numpy(), out.numpy()
        vectors = HAS_F32_FMA and rows.dtype == torch.float32  # float64 (tests) takes the plain loops
        if not vectors:
            linear_blocks(x, b.quants, b.scales, b.offsets, self._bias, b.kind not in BYTE_QUANTS, o)
        elif b.kind in BYTE_QUANTS:
            (linear_q8_wide if self.lanes == 16 else linear_q8_fma)(x, b.quants, b.scales, o)
        else:
            (linear_q4_wide if self.lanes == 16 else linear_q4_fma)(x, b.quants, b.scales, b.offsets, self._bias, o)
        return out

    def _widened(self, rows: torch.Tensor) -> torch.Tensor:
        """rows @ W.T in GEMMs over WIDEN_BYTES of de-quantized weight rows at a time."""
        b = self.block
        out = torch.empty(rows.shape[0], b.rows, dtype=rows.dtype)
        step = max(1, WIDEN_BYTES // (4 * b.cols))
        tile = torch.empty(min(step, b.rows), b.cols, dtype=torch.float32)
        for first in range(0, b.rows, step):
            count = min(step, b.rows - first)
            part = tile[:count]
            dequantize_rows(b.quants, b.scales, b.offsets, b.kind not in BYTE_QUANTS, self._bias, first, part.numpy())
            out[:, first:first + count] = F.linear(rows, part.to(rows.dtype))
        return out
