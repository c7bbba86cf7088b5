"""One step of a block matrix's columns de-quantized in registers, for the Triton block kernels
(triforce.kernels.cuda.quant_triton's dot kernel, quant_gemv's few-row kernel): the packed bytes
of BLOCK_N weight rows and the blocks' factors are loaded once, each factor spread over the
bytes it scales, and the weights computed in float32 as BlockWeight.dequantized does.

4-bit formats: byte j of a block holds weight j in its low nibble and weight j + 16 in its high
one, so a step returns the low and the high halves with the columns they meet. Q4_K's factors
are d256 sc and -(dmin256 m), the products BlockWeight holds. Q6_K keeps its low nibbles in the
same order, adds the two high bits of each weight from a byte of four pairs and scales each 16
weights by d256 sc. Signed bytes: Q8_0's scale per 32 weights. Importing this module needs
`triton`."""
import triton
import triton.language as tl


@triton.jit
def spread(factors, BLOCK_N: tl.constexpr, COUNT: tl.constexpr, WIDTH: tl.constexpr):
    """[BLOCK_N, COUNT] factors (one per block or scale group) -> [BLOCK_N, COUNT * WIDTH], each
    repeated over the WIDTH bytes or columns it scales."""
    return tl.reshape(tl.broadcast_to(factors[:, :, None], (BLOCK_N, COUNT, WIDTH)), (BLOCK_N, COUNT * WIDTH))


@triton.jit
def q4_step(q_ptr, s_ptr, o_ptr, k_ptr, offs_n, n_ok, first, blocks, K, SHIFT: tl.constexpr,
            HAS_OFFSETS: tl.constexpr, KQUANT: tl.constexpr, BLOCK_N: tl.constexpr, STEP: tl.constexpr):
    """Blocks first .. first + STEP of the rows offs_n: float32 lo, hi [BLOCK_N, STEP * 16], the
    columns col [STEP * 16] the low halves meet (the high halves meet col + 16), and k_ok."""
    j = tl.arange(0, STEP * 16)                  # the step's bytes of a row
    b = tl.arange(0, STEP)                       # the step's blocks
    blk = first + j // 16
    k_ok = blk < blocks
    byte = tl.load(q_ptr + offs_n[:, None] * (K // 2) + (first * 16 + j)[None, :],
                   mask=n_ok[:, None] & k_ok[None, :], other=0)
    b_ok = n_ok[:, None] & (first + b < blocks)[None, :]
    d = tl.load(s_ptr + offs_n[:, None] * blocks + (first + b)[None, :], mask=b_ok, other=0).to(tl.float32)
    if KQUANT:
        sup = k_ptr + offs_n[:, None] * (blocks // 8 * 2) + ((first + b) // 8 * 2)[None, :]
        d = tl.load(sup, mask=b_ok, other=0.0) * d
    d = spread(d, BLOCK_N, STEP, 16)
    lo = d * ((byte & 15).to(tl.float32) - SHIFT)
    hi = d * ((byte >> 4).to(tl.float32) - SHIFT)
    if HAS_OFFSETS:
        m = tl.load(o_ptr + offs_n[:, None] * blocks + (first + b)[None, :], mask=b_ok, other=0).to(tl.float32)
        if KQUANT:
            m = -(tl.load(sup + 1, mask=b_ok, other=0.0) * m)
        m = spread(m, BLOCK_N, STEP, 16)
        lo += m
        hi += m
    return lo, hi, blk * 32 + j % 16, k_ok


@triton.jit
def q6_step(q_ptr, s_ptr, h_ptr, d_ptr, offs_n, n_ok, first, blocks, K, BLOCK_N: tl.constexpr, STEP: tl.constexpr):
    """Q6_K's blocks first .. first + STEP of the rows offs_n, as q4_step returns them: the low
    nibbles (q_ptr), the high bit pairs (h_ptr: byte j of a block's 8 holds those of weights j,
    j + 8, j + 16, j + 24, lowest first), sc int8 per 16 weights (s_ptr), d float32 per 256 (d_ptr)."""
    j = tl.arange(0, STEP * 16)                  # the step's nibble bytes of a row
    b = tl.arange(0, STEP)                       # the step's blocks
    blk = first + j // 16
    t = j % 16                                   # weight t of its block (low nibble), t + 16 (high)
    k_ok = blk < blocks
    ok = n_ok[:, None] & k_ok[None, :]
    byte = tl.load(q_ptr + offs_n[:, None] * (K // 2) + (first * 16 + j)[None, :], mask=ok, other=0).to(tl.int32)
    pairs = tl.load(h_ptr + offs_n[:, None] * (K // 4) + (blk * 8 + t % 8)[None, :], mask=ok, other=0).to(tl.int32)
    shift = (t // 8 * 2)[None, :]
    lo_q = (byte & 15) | (((pairs >> shift) & 3) << 4)
    hi_q = (byte >> 4) | (((pairs >> (shift + 4)) & 3) << 4)
    b_ok = n_ok[:, None] & (first + b < blocks)[None, :]
    d = tl.load(d_ptr + offs_n[:, None] * (blocks // 8) + ((first + b) // 8)[None, :], mask=b_ok, other=0.0)
    sc = s_ptr + offs_n[:, None] * (blocks * 2) + (2 * (first + b))[None, :]
    d_lo = spread(d * tl.load(sc, mask=b_ok, other=0).to(tl.float32), BLOCK_N, STEP, 16)
    d_hi = spread(d * tl.load(sc + 1, mask=b_ok, other=0).to(tl.float32), BLOCK_N, STEP, 16)
    lo = d_lo * (lo_q.to(tl.float32) - 32.0)
    hi = d_hi * (hi_q.to(tl.float32) - 32.0)
    return lo, hi, blk * 32 + t, k_ok


@triton.jit
def byte_step(q_ptr, s_ptr, offs_n, n_ok, first, K, GROUP: tl.constexpr, BLOCK_N: tl.constexpr,
              STEP: tl.constexpr):
    """Columns first * 32 .. + STEP * 32 of the rows offs_n: float32 w [BLOCK_N, STEP * 32], the
    columns col [STEP * 32] and k_ok."""
    col = first * 32 + tl.arange(0, STEP * 32)
    k_ok = col < K
    q = tl.load(q_ptr + offs_n[:, None] * K + col[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0)
    g = first * 32 // GROUP + tl.arange(0, STEP * 32 // GROUP)  # the step's scale groups, once each
    d = tl.load(s_ptr + offs_n[:, None] * (K // GROUP) + g[None, :], mask=n_ok[:, None] & (g < K // GROUP)[None, :],
                other=0).to(tl.float32)
    return spread(d, BLOCK_N, STEP * 32 // GROUP, GROUP) * q.to(tl.float32), col, k_ok
