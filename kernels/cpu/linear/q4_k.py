"""GGUF's Q4_K as the 4-bit blocks the kernels already read (triforce.kernels.cpu.linear.block_formats).

A Q4_K super-block holds 256 weights of a row in 144 bytes: float16 d and dmin, twelve bytes of
eight 6-bit scales sc and mins m (one pair per 32 weights), and 128 bytes of nibbles; weight i of
sub-block s is d sc_s q_i - dmin m_s. That is a Q4_1 block per sub-block with scale d sc_s and
offset -dmin m_s, both exact in float32 (an 11-bit float16 mantissa times a 6-bit integer), so
the blocks run through the Q4_1 kernels and de-quantize to the bits the gguf package gives. Only
the nibbles move: Q4_K puts sub-blocks 2j and 2j + 1 in the low and high nibbles of the same 32
bytes, Q4_1 weights t and t + 16 of one sub-block in one byte.

`quantize_q4_k` is a plain quantizer for checkpoints loaded with `--quantize q4_k` (each
sub-block's range, its scale and min rounded to 6 bits of the super-block's largest; llama.cpp
searches for better ones): it writes the file's layout, read back through the same path."""
from __future__ import annotations

import numpy as np
from gguf.quants import Q4_K

SUPER = 256
SUPER_BYTES = 144


def q4_k_factors(raw: np.ndarray, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray]:
    """The super-blocks' own scale factors, as a GPU holds them (4.75 bits a weight with the
    nibbles): sc and m uint8 [rows, cols // 32, 2], d and dmin float32 [rows, cols // 256, 2]."""
    n = rows * (cols // SUPER)
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(n, SUPER_BYTES)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, m = Q4_K.get_scale_min(blocks[:, 4:16].copy())
    sc_m = np.stack([sc.reshape(n, 8), m.reshape(n, 8)], -1).astype(np.uint8).reshape(rows, cols // 32, 2)
    return sc_m, np.concatenate([d, dmin], -1).reshape(rows, cols // SUPER, 2)


def q4_k_blocks(raw: np.ndarray, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """raw uint8 [rows, cols // 256 * 144] -> (quants uint8 [rows, cols // 2] in Q4_1's nibble
    order, scales and offsets float32 [rows, cols // 32])."""
    n = rows * (cols // SUPER)
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(n, SUPER_BYTES)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, m = Q4_K.get_scale_min(blocks[:, 4:16].copy())
    scales = d * sc.astype(np.float32)
    offsets = -(dmin * m.astype(np.float32))
    qs = blocks[:, 16:].reshape(n, 4, 1, 32)
    values = ((qs >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 0x0F).reshape(n, 8, 32)
    quants = (values[:, :, :16] | (values[:, :, 16:] << 4)).astype(np.uint8)
    return (quants.reshape(rows, cols // 2), np.ascontiguousarray(scales.reshape(rows, -1)),
            np.ascontiguousarray(offsets.reshape(rows, -1)))


def quantize_q4_k(weight: np.ndarray) -> np.ndarray:
    """float32 [rows, cols] (cols a multiple of 256) -> the Q4_K bytes uint8 [rows, cols // 256 * 144]."""
    rows, cols = weight.shape
    n = rows * (cols // SUPER)
    x = weight.astype(np.float32).reshape(n, 8, 32)
    low = np.minimum(x.min(-1), 0.0)
    scale, minimum = (x.max(-1) - low) / 15, -low  # per sub-block: w ~ scale q - minimum, q in 0..15
    d = (scale.max(-1) / 63).astype(np.float16)
    dmin = (minimum.max(-1) / 63).astype(np.float16)
    sc = _six_bits(scale, d)
    m = _six_bits(minimum, dmin)
    step = d.astype(np.float32)[:, None] * sc
    shift = dmin.astype(np.float32)[:, None] * m
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(step[..., None] > 0, np.rint((x + shift[..., None]) / step[..., None]), 0)
    q = np.clip(q, 0, 15).astype(np.uint8)
    out = np.empty((n, SUPER_BYTES), np.uint8)
    out[:, 0:2] = d[:, None].view(np.uint8)
    out[:, 2:4] = dmin[:, None].view(np.uint8)
    out[:, 4:8] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    out[:, 8:12] = (m[:, :4] & 63) | ((m[:, 4:] >> 4) << 6)
    out[:, 12:16] = (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4)
    out[:, 16:] = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(n, 128)
    return out.reshape(rows, -1)


def _six_bits(values: np.ndarray, unit: np.ndarray) -> np.ndarray:
    """values [n, 8] as multiples 0..63 of unit [n] (float16), rounded."""
    u = unit.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        k = np.where(u > 0, np.rint(values / u), 0)
    return np.clip(k, 0, 63).astype(np.uint8)


Q6_K_BYTES = 210  # per 256 weights: 128 low nibbles, 64 bytes of high bit pairs, 16 int8 scales, float16 d


def q6_k_blocks(raw: np.ndarray, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray]:
    """GGUF's Q6_K (weight = d sc_j (q - 32), q 6 bits, one int8 sc per 16 weights) as int8 quants
    q - 32 [rows, cols] in the weights' order and float32 scales d sc [rows, cols // 16] (exact:
    an 11-bit mantissa times an 8-bit integer), the arrays the Q8_0 kernels read with 16-weight
    blocks. The bit layout is the gguf package's de-quantizer's."""
    n = rows * (cols // SUPER)
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(n, Q6_K_BYTES)
    ql, qh, sc, d = blocks[:, :128], blocks[:, 128:192], blocks[:, 192:208], blocks[:, 208:210]
    scales = d.copy().view(np.float16).astype(np.float32) * sc.copy().view(np.int8).astype(np.float32)
    low = ((ql.reshape(n, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 0x0F).reshape(n, 2, 4, 32)
    high = ((qh.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & 0x03)
    quants = (low | (high << 4)).astype(np.int8) - np.int8(32)
    return quants.reshape(rows, cols), np.ascontiguousarray(scales.reshape(rows, cols // 16))


def q6_k_factors(raw: np.ndarray, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray]:
    """Q6_K's own scale factors, as a GPU holds them: sc int8 [rows, cols // 16] and d float32
    [rows, cols // 256] (their float32 product is q6_k_blocks' scale, bit for bit)."""
    n = rows * (cols // SUPER)
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(n, Q6_K_BYTES)
    sc = blocks[:, 192:208].copy().view(np.int8).reshape(rows, cols // 16)
    d = blocks[:, 208:210].copy().view(np.float16).astype(np.float32).reshape(rows, cols // SUPER)
    return sc, d
