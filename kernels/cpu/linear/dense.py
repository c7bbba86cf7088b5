"""Linear layers for a few rows on the CPU: decoding's matrix-vector products at the memory limit.

Why: for one to a few input rows, `F.linear` on this build (MKL sgemm, oneDNN for bfloat16) reads
the weights at about a third of the memory bandwidth the same two cores reach with a plain sum
(measured by bench/vs_llamacpp.py). Decoding reads every weight once per token, so the weight
stream is the token's cost. These numba kernels walk the weight row by row (each row read from
memory once and used for every input row), split the rows across the cores and accumulate in
float32 with the reductions vectorised (fastmath: reassociated sums, no other licence needed).

bfloat16 weights travel as raw bits (numba has no bfloat16): on CPUs with AVX512-BF16 the
products run on its bfloat16 dot instruction (triforce.kernels.cpu.simd.bf16_dot), elsewhere the bits are
widened to float32 as read; the result is rounded to the weight dtype once, as torch's bfloat16
linear does. On CPUs with FMA and AVX2 (and no bfloat16 dot) weights take explicit 8-lane fused
multiply-adds (triforce.kernels.cpu.simd.f32_dot: a weight row read once for four input rows). More rows than SMALL_ROWS
(prefill) go to F.linear, whose blocked GEMM is compute-efficient there; on a CPU that does not
multiply 16-bit weights natively (triforce.kernels.cpu.simd.features) they are widened to float32 a block
of rows at a time for it, since PyTorch's emulated 16-bit GEMM runs ~7x slower than float32's."""
from __future__ import annotations

import sys
import warnings

import numba
import numpy as np
import torch
import torch.nn.functional as F
from numba import prange, types
from numba.core.errors import NumbaPerformanceWarning
from numba.extending import overload

from triforce.kernels.cpu.row_jobs import job_span, row_jobs
from triforce.kernels.cpu.simd.bf16_bits import bits_of, to_float32
from triforce.kernels.cpu.simd import bf16_dot, f32_dot
from triforce.kernels.cpu.simd.bf16_dot import HAS_BF16_DOT, PAIR_BLOCK, bf16_rows
from triforce.kernels.cpu.simd.f32_dot import HAS_F32_FMA, STEP
from triforce.kernels.cpu.simd.prefetch import ASK_AHEAD, ASK_FROM_ROWS, ask_rows
from triforce.kernels.cpu.simd.features import native_matmul
from triforce.kernels.device_kind import on_host

SMALL_ROWS = 16  # up to this many input rows the weight stream dominates: the kernels below
MIN_WEIGHTS = 1 << 17  # smaller matrices sit in cache, where F.linear's lower call cost wins
WIDEN_BYTES = 8 << 20  # float32 weight rows widened at once for a GEMM: bounded whatever the model


def _dot(w, x, width):
    raise NotImplementedError("numba only: see the overload")


@overload(_dot, inline="always")
def _dot_for(w, x, width):
    """A weight row's dot with an input row: bfloat16 pairs for bits, float32 FMA steps else."""
    return (lambda w, x, width: bf16_dot.dot(w, x, width)) if x.dtype == types.uint16 else \
        (lambda w, x, width: f32_dot.dot(w, x, width))


def _dot4(w, x0, x1, x2, x3, width):
    raise NotImplementedError("numba only: see the overload")


@overload(_dot4, inline="always")
def _dot4_for(w, x0, x1, x2, x3, width):
    """_dot with four input rows, each through the same steps as alone (w loaded once)."""
    return (lambda w, x0, x1, x2, x3, width: bf16_dot.dot4(w, x0, x1, x2, x3, width)) if x0.dtype == types.uint16 \
        else (lambda w, x0, x1, x2, x3, width: f32_dot.dot4(w, x0, x1, x2, x3, width))


@numba.njit(parallel=True, cache=True)
def rows_times_weights(x, w, out):
    """out[i, r] = x[i] . w[r] on the explicit-vector dots: x bfloat16 bits with w bfloat16 bits
    (AVX512-BF16 pairs, width a multiple of PAIR_BLOCK; only where HAS_BF16_DOT), or x float32
    with w float32 or bfloat16 bits (FMA, width a multiple of STEP; only where HAS_F32_FMA).
    A weight row is read once for every input row, four rows at a time, each summed as alone."""
    rows, width = x.shape
    n = w.shape[0]
    for block in prange(row_jobs(n)):
        start, stop = job_span(block, n)
        for r in range(start, stop):
            if rows >= ASK_FROM_ROWS:
                ask_rows(w, r + ASK_AHEAD, 1)
            wr = w[r]
            i = 0
            while i + 4 <= rows:
                out[i, r], out[i + 1, r], out[i + 2, r], out[i + 3, r] = _dot4(
                    wr, x[i], x[i + 1], x[i + 2], x[i + 3], width)
                i += 4
            while i < rows:
                out[i, r] = _dot(wr, x[i], width)
                i += 1


@numba.njit(parallel=True, fastmath=True, cache=True)
def linear_widening(x, w, out):
    """out[i, r] = x[i] . w[r]; w float32 or bfloat16 bits (widened as read), x and out float32."""
    rows, width = x.shape
    n = w.shape[0]
    for block in prange(row_jobs(n)):
        start, stop = job_span(block, n)
        for r in range(start, stop):
            for i in range(rows):
                acc = np.float32(0.0)
                for j in range(width):
                    acc += to_float32(w[r, j]) * x[i, j]
                out[i, r] = acc


def _product(x, w, out):
    raise NotImplementedError("numba only: see the overload")


@overload(_product)
def _product_for(x, w, out):
    """Chosen when numba compiles: bfloat16 weights on a CPU with the bfloat16 dot go through it
    (x holds bfloat16 values wherever such weights are used: exact as bits), other float32 or
    bfloat16 weights on a CPU with FMA through triforce.kernels.cpu.simd.f32_dot, all else widens. The
    choice depends on the weight's width only, never on the rows, so a row's result is the same
    in any pass."""
    if w.dtype == types.uint16 and HAS_BF16_DOT:
        def by_pairs(x, w, out):
            if x.shape[1] % PAIR_BLOCK == 0:
                rows_times_weights(bf16_rows(x), w, out)
            else:
                linear_widening(x, w, out)
        return by_pairs
    if HAS_F32_FMA:  # float32, or bfloat16 bits widened as loaded (a weight row is read once)
        def by_fma(x, w, out):
            if x.shape[1] % STEP == 0:
                rows_times_weights(x, w, out)
            else:
                linear_widening(x, w, out)
        return by_fma
    return lambda x, w, out: linear_widening(x, w, out)


# parallel=True although it has no loop of its own: a cached function that calls a parallel one
# segfaulted when loaded from numba's cache (numba issues 4807 and 8578; seen here after several
# processes wrote the cache). Numba's notice that it found nothing to parallelise would reach
# users at the first compile: silenced (here, as every such caller imports this module).
warnings.filterwarnings("ignore", message=r"(?s).*'parallel=True' was specified but no transformation",
                        category=NumbaPerformanceWarning)


@numba.njit(parallel=True, cache=True)
def small_rows_linear(x, w, out):
    """out[i, r] = x[i] . w[r] for x [rows, width] float32 (bfloat16 values when w is bfloat16
    bits), w [n, width] float32 or bfloat16 bits; float32 out. The kernel every caller uses."""
    _product(x, w, out)


class FusedLinear:
    """A linear layer over `weight` [out, in] (and `bias`) made once, called per pass: the small-
    rows kernel on the CPU (float32, bfloat16) when a pass has few rows, F.linear otherwise (its
    16-bit weights widened by blocks where the CPU would emulate them). The numpy views are made
    here, so a call costs the kernel plus a few microseconds."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, keep_float32: bool = False):
        """keep_float32: 16-bit weights give float32 results, the kernels' sums unrounded (a
        model's logits: bfloat16's spacing of 0.125 at logit 16 would make exact ties of near ones)."""
        self.weight, self.bias = weight.detach(), None if bias is None else bias.detach()
        self.out_features, self.in_features = self.weight.shape
        half = self.weight.dtype in (torch.bfloat16, torch.float16)
        self.out_dtype = torch.float32 if keep_float32 and half else self.weight.dtype
        self._kernel = None
        self.float32_sums_failed: str | None = None  # why linear_float32 was given up, if it was
        if on_host(self.weight) and self.weight.is_contiguous() and self.weight.numel() >= MIN_WEIGHTS:
            if self.weight.dtype in (torch.float32, torch.bfloat16):
                self._kernel, self._w = small_rows_linear, bits_of(self.weight)
        self._bias32 = None if self.bias is None else self.bias.to(torch.float32)
        self._widen = half and on_host(self.weight) and not native_matmul(self.weight.dtype)
        self._device_sums = self.out_dtype != self.weight.dtype and not on_host(self.weight)  # linear_float32

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if self._widen and rows.shape[0] > SMALL_ROWS and x.dtype == self.weight.dtype:
            return self._widened(rows).view(*x.shape[:-1], self.weight.shape[0])
        if self._kernel is None or rows.shape[0] > SMALL_ROWS or x.dtype != self.weight.dtype:
            if self._device_sums and x.dtype == self.weight.dtype and self.float32_sums_failed is None:
                try:
                    return linear_float32(x, self.weight, self.bias)  # a device's logits, never rounded to 16 bits
                except (RuntimeError, TypeError) as e:  # a torch without mm's out_dtype: rounded logits from now on
                    self.float32_sums_failed = str(e).splitlines()[0] if str(e) else type(e).__name__
                    print(f"note: float32 logits unavailable ({self.float32_sums_failed}); rounding them to "
                          f"{str(x.dtype).removeprefix('torch.')}", file=sys.stderr)
            return F.linear(x, self.weight, self.bias).to(self.out_dtype)
        if rows.dtype != torch.float32 or not rows.is_contiguous():
            rows = rows.to(torch.float32).contiguous()  # .to(memory_format=...) keeps float32 rows strided
        out = torch.empty(rows.shape[0], self.weight.shape[0], dtype=torch.float32, device="cpu")
        self._kernel(rows.numpy(), self._w, out.numpy())
        if self._bias32 is not None:
            out += self._bias32
        return out.view(*x.shape[:-1], self.weight.shape[0]).to(self.out_dtype)

    def _widened(self, rows: torch.Tensor) -> torch.Tensor:
        """rows @ weight.T (+ bias) in float32 GEMMs, each over a float32 copy of WIDEN_BYTES of
        weight rows, rounded once into out_dtype: no float32 copy of the whole weight or result."""
        n, width = self.weight.shape
        x32 = rows.to(torch.float32)
        out = torch.empty(rows.shape[0], n, dtype=self.out_dtype, device=rows.device)
        step = max(1, WIDEN_BYTES // (4 * width))
        for first in range(0, n, step):
            w32 = self.weight[first:first + step].to(torch.float32)
            if self._bias32 is None:
                out[:, first:first + step] = x32 @ w32.t()
            else:
                out[:, first:first + step] = torch.addmm(self._bias32[first:first + step], x32, w32.t())
        return out


def linear_float32(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias) of 16-bit x and weight as float32, the float32 sums unrounded: CUDA's
    mm with out_dtype (tensor cores, no widened copy of the weight); elsewhere (a simulated card)
    the same products on widened operands."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.is_cuda:
        out = torch.mm(rows, weight.t(), out_dtype=torch.float32)
    else:  # WIDEN_BYTES of weight rows widened at a time: a card's mm holds no float32 copy of the weight
        x32, step = rows.to(torch.float32), max(1, WIDEN_BYTES // (4 * weight.shape[1]))
        out = torch.empty(rows.shape[0], weight.shape[0], dtype=torch.float32, device=rows.device)
        for first in range(0, weight.shape[0], step):
            torch.mm(x32, weight[first:first + step].to(torch.float32).t(), out=out[:, first:first + step])
    if bias is not None:
        out += bias.to(torch.float32)
    return out.view(*x.shape[:-1], weight.shape[0])


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear's contract (x [..., in], weight [out, in]) through FusedLinear (one-offs)."""
    return FusedLinear(weight, bias)(x)


def warm_up(dtype: torch.dtype) -> None:
    """Compile the small-rows kernel for `dtype` now (or load it from numba's cache)."""
    if dtype in (torch.float32, torch.bfloat16):
        x = np.zeros((1, 8), np.float32)
        w = np.zeros((8, 8), np.float32 if dtype == torch.float32 else np.uint16)
        small_rows_linear(x, w, np.zeros((1, 8), np.float32))  # compiles both of _product's branches
