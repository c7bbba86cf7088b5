"""The few-row block kernel (quant_launch's "gemv"): out = x W^T for up to GEMV_ROWS rows of
16-bit activations, W read as its blocks.

Each program takes BLOCK_N weight rows and one range of the column steps (a split), de-quantizes
a step once (quant_steps) and multiplies it with each of the pass's rows on CUDA cores: the
weight rounded to the activations' dtype as the reference F.linear over the de-quantized weight
rounds it, the products summed in float32 across the step, then added to the row's float32 sum.
A row's arithmetic is the same whatever the other rows of its pass. No tl.dot: its 16-row tiles
were mostly padding at one row. Importing this module needs `triton`."""
import triton
import triton.language as tl

from triforce.kernels.cuda.quant_steps import byte_step, q4_step, q6_step


@triton.jit
def blocks_gemv_kernel(x_ptr, q_ptr, s_ptr, o_ptr, k_ptr, b_ptr, out_ptr, M, N, K, sx, so,
                       Q4: tl.constexpr, Q6: tl.constexpr, SHIFT: tl.constexpr, HAS_OFFSETS: tl.constexpr,
                       KQUANT: tl.constexpr,
                       HAS_BIAS: tl.constexpr, GROUP: tl.constexpr, ROWS: tl.constexpr,
                       BLOCK_N: tl.constexpr, STEP: tl.constexpr, SPLIT: tl.constexpr):
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    r = tl.arange(0, ROWS)
    blocks = K // 32
    per = tl.cdiv(tl.cdiv(blocks, STEP), SPLIT) * STEP  # this program's columns (all unless SPLIT > 1)
    begin = tl.program_id(2) * per
    end = tl.minimum(begin + per, blocks)
    x_type = x_ptr.dtype.element_ty
    acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
    for first in range(begin, end, STEP):
        if Q4:
            if Q6:
                lo, hi, col, k_ok = q6_step(q_ptr, s_ptr, o_ptr, k_ptr, offs_n, n_ok, first, blocks, K, BLOCK_N, STEP)
            else:
                lo, hi, col, k_ok = q4_step(q_ptr, s_ptr, o_ptr, k_ptr, offs_n, n_ok, first, blocks, K, SHIFT,
                                            HAS_OFFSETS, KQUANT, BLOCK_N, STEP)
            lo = lo.to(x_type).to(tl.float32)
            hi = hi.to(x_type).to(tl.float32)
            for i in tl.static_range(ROWS):
                row = x_ptr + tl.minimum(i, M - 1) * sx  # a padding row reads the last (never stored)
                x_lo = tl.load(row + col, mask=k_ok, other=0.0).to(tl.float32)
                x_hi = tl.load(row + col + 16, mask=k_ok, other=0.0).to(tl.float32)
                part = tl.sum(lo * x_lo[None, :] + hi * x_hi[None, :], axis=1)
                acc = tl.where((r == i)[:, None], acc + part[None, :], acc)
        else:
            w, col, k_ok = byte_step(q_ptr, s_ptr, offs_n, n_ok, first, K, GROUP, BLOCK_N, STEP)
            w = w.to(x_type).to(tl.float32)
            for i in tl.static_range(ROWS):
                row = x_ptr + tl.minimum(i, M - 1) * sx
                xs = tl.load(row + col, mask=k_ok, other=0.0).to(tl.float32)
                part = tl.sum(w * xs[None, :], axis=1)
                acc = tl.where((r == i)[:, None], acc + part[None, :], acc)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0)[None, :]
    out_ptr += tl.program_id(2) * M * so  # a split's own [M, N] of the float32 sums
    tl.store(out_ptr + r[:, None] * so + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=(r < M)[:, None] & n_ok[None, :])


@triton.jit
def sum_splits_kernel(sums_ptr, b_ptr, out_ptr, MN, N, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr,
                      BLOCK: tl.constexpr):
    """out [M, N] = sums[0] + sums[1] + ... (+ bias), in that order: a row's result does not
    depend on which program finished first."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < MN
    acc = tl.load(sums_ptr + offs, mask=ok, other=0.0)
    for s in tl.static_range(1, SPLIT):
        acc += tl.load(sums_ptr + s * MN + offs, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs % N, mask=ok, other=0.0)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)
