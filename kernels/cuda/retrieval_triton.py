"""Triton kernels for building the retrieval cache: chunk scoring and the gather of selected
tokens' KV. Each has its torch reference in `retrieval.py` (the tests compare them: on CUDA for
real, on CPU through TRITON_INTERPRET=1). Top-k has no kernel of its own: one device sort
(`retrieval.topk_sorted`) already spreads a row over many blocks, where a program per row
rescanning all its scores did not.

Importing this module needs `triton`; `retrieval.py` imports it only when available."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

SCORE_BLOCK = 128     # chunks per program in scoring
GATHER_BLOCK = 64     # tokens per program in the gather


@triton.jit
def _chunk_scores_kernel(q_ptr, m_ptr, out_ptr, num_chunks, kv_heads, groups, dim,
                         q_sb, q_sh, m_sb, m_sh, m_sn, o_sb, o_sh,
                         BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_G: tl.constexpr):
    row = tl.program_id(0)           # b * kv_heads + kv head
    b, h = row // kv_heads, row % kv_heads
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_g = tl.arange(0, BLOCK_G)
    d_ok = offs_d < dim
    q = tl.load(q_ptr + b * q_sb + (h * groups + offs_g)[:, None] * q_sh + offs_d[None, :],
                mask=(offs_g < groups)[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
    q_sum = tl.sum(q, axis=0)        # the group's queries share the keys: sum them first
    n_ok = offs_n < num_chunks
    m = tl.load(m_ptr + b * m_sb + h * m_sh + offs_n[:, None] * m_sn + offs_d[None, :],
                mask=n_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
    tl.store(out_ptr + b * o_sb + h * o_sh + offs_n, tl.sum(m * q_sum[None, :], axis=1), mask=n_ok)


def chunk_scores(query: torch.Tensor, means: torch.Tensor) -> torch.Tensor:
    """query [B, H, D], means [B, Hkv, N, D] (last dim contiguous) -> float32 [B, Hkv, N]."""
    batch, heads, dim = query.shape
    kv_heads, num_chunks = means.shape[1], means.shape[2]
    if means.stride(-1) != 1 or query.stride(-1) != 1:
        raise ValueError("chunk_scores needs the head dimension contiguous")
    out = torch.empty(batch, kv_heads, num_chunks, dtype=torch.float32, device=means.device)
    if num_chunks == 0:
        return out
    grid = (batch * kv_heads, triton.cdiv(num_chunks, SCORE_BLOCK))
    _chunk_scores_kernel[grid](query, means, out, num_chunks, kv_heads, heads // kv_heads, dim,
                               query.stride(0), query.stride(1), means.stride(0), means.stride(1), means.stride(2),
                               out.stride(0), out.stride(1), BLOCK_N=SCORE_BLOCK,
                               BLOCK_D=triton.next_power_of_2(dim),
                               BLOCK_G=max(2, triton.next_power_of_2(heads // kv_heads)))
    return out


@triton.jit
def _gather_kernel(k_src, v_src, idx_ptr, k_dst, v_dst, num, kv_heads, dim,
                   s_sb, s_sh, s_sn, i_sb, i_sh, d_sb, d_sh, d_sn,
                   BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0)
    b, h = row // kv_heads, row % kv_heads
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    n_ok = offs_n < num
    ok = n_ok[:, None] & (offs_d < dim)[None, :]
    token = tl.load(idx_ptr + b * i_sb + h * i_sh + offs_n, mask=n_ok, other=0)
    src = b * s_sb + h * s_sh + token[:, None] * s_sn + offs_d[None, :]
    dst = b * d_sb + h * d_sh + offs_n[:, None] * d_sn + offs_d[None, :]
    tl.store(k_dst + dst, tl.load(k_src + src, mask=ok), mask=ok)
    tl.store(v_dst + dst, tl.load(v_src + src, mask=ok), mask=ok)


def gather_into(k_src: torch.Tensor, v_src: torch.Tensor, index: torch.Tensor,
                k_dst: torch.Tensor, v_dst: torch.Tensor) -> None:
    """k_dst[b, h, i] = k_src[b, h, index[b, h, i]] (and v). src [B, Hkv, S, D], index [B, Hkv, N],
    dst [B, Hkv, N, D]; src and dst may be strided views with the last dim contiguous."""
    batch, kv_heads, num = index.shape
    dim = k_src.shape[-1]
    for t in (k_src, v_src, k_dst, v_dst):
        if t.stride(-1) != 1:
            raise ValueError("gather_into needs the head dimension contiguous")
    if k_src.stride() != v_src.stride() or k_dst.stride() != v_dst.stride():
        raise ValueError("keys and values must share their layout")
    if num == 0:
        return
    grid = (batch * kv_heads, triton.cdiv(num, GATHER_BLOCK))
    _gather_kernel[grid](k_src, v_src, index, k_dst, v_dst, num, kv_heads, dim,
                         k_src.stride(0), k_src.stride(1), k_src.stride(2), index.stride(0), index.stride(1),
                         k_dst.stride(0), k_dst.stride(1), k_dst.stride(2),
                         BLOCK_N=GATHER_BLOCK, BLOCK_D=triton.next_power_of_2(dim))
