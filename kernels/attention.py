"""Attention of new queries over a KV view.

Convention shared by every cache: the T new queries are the *last* T positions of the S keys
("bottom-right aligned" causality), so query i may see key j iff j <= S - T + i.
"""
from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

import triforce.kernels.cpu.attention.decode as cpu_attention
from triforce.kernels.cpu.attention.buffers import BufferDecoder
from triforce.kernels.device_kind import on_cuda
from triforce.kernels.partial import (block_kind, causal_pieces, fusable, fused_partial, fused_shape,
                                      partial_attention)


def causal_mask(num_queries: int, num_keys: int, device: torch.device,
                sliding_window: int | None = None) -> torch.Tensor:
    """Boolean [T, S] mask, True where query i may attend to key j."""
    offset = num_keys - num_queries
    q_idx = torch.arange(num_queries, device=device)[:, None] + offset
    k_idx = torch.arange(num_keys, device=device)[None, :]
    allowed = k_idx <= q_idx
    if sliding_window is not None:
        allowed &= k_idx > q_idx - sliding_window
    return allowed


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float,
              sliding_window: int | None = None, fold_masked_gqa: bool | None = None,
              cpu_kernel: bool = True) -> torch.Tensor:
    """q: [B, H, T, D]; k, v: [B, Hkv, S, D] with H a multiple of Hkv. Returns [B, H, T, D].
    fold_masked_gqa (default: on CUDA) serves masked GQA by folding query heads into rows.
    cpu_kernel: decoding steps on the CPU go to triforce.kernels.cpu.attention.decode (False: SDPA)."""
    if cpu_kernel and cpu_attention.takes(q, k, v, sliding_window):
        return cpu_attention.attention(q, k, v, scale=scale)
    if cpu_kernel and cpu_attention.takes_prefill(q, k, v, sliding_window):
        return cpu_attention.prefill_attention(q, k, v, scale=scale)
    num_queries, num_keys = q.shape[-2], k.shape[-2]
    window_binds = sliding_window is not None and num_keys > sliding_window
    gqa = q.shape[1] != k.shape[1]
    if num_queries == 1 and not window_binds:
        # One query sees every key: fold the query heads sharing a KV head into rows, so the
        # kernel reads each K/V head once instead of expanding it per query head.
        batch, heads, _, dim = q.shape
        folded = q.reshape(batch, k.shape[1], heads // k.shape[1], dim)
        return F.scaled_dot_product_attention(folded, k, v, scale=scale).reshape(batch, heads, 1, dim)
    if num_queries == num_keys and not window_binds:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    if num_queries > cpu_attention.SMALL_QUERIES and not window_binds and fused_shape(
            q, num_keys, num_keys - num_queries, 0, None) == "diagonal":
        # a prefill chunk after the first on the CPU: the keys before it whole, then its own keys
        # as a causal square the kernel masks itself (~1.3x over a mask it must read and apply)
        out, _ = fused_partial(q, k, v, scale=scale, shape="diagonal", q_start=num_keys - num_queries, k_start=0)
        return out.to(q.dtype)
    mask = causal_mask(num_queries, num_keys, q.device, sliding_window if window_binds else None)
    if not gqa or not (on_cuda(q) if fold_masked_gqa is None else fold_masked_gqa):
        # the CPU's flash kernel takes a mask with GQA (and beats the folded form about 1.5x)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
    # On CUDA, fold the query heads that share a KV head into rows, each row seeing what its query
    # sees: no fused kernel needs to take a mask with enable_gqa (older PyTorch fell back to the
    # math kernel and its [B, H, T, S] float32 scores; torch 2.11 on an H100 did not).
    batch, heads, _, dim = q.shape
    groups = heads // k.shape[1]
    folded = q.reshape(batch, k.shape[1], groups * num_queries, dim)
    out = F.scaled_dot_product_attention(folded, k, v, attn_mask=mask.repeat(groups, 1), scale=scale)
    return out.reshape(batch, heads, num_queries, dim)


def _fused_pieces(q, k, v, scale: float, q_start: int, k_start: int) -> tuple[torch.Tensor, torch.Tensor]:
    """partial_attention's result for a block causal_pieces splits, each piece in the fused kernel."""
    outs, lses = [], []
    for first, end, keys, shape in causal_pieces(q.shape[2], k.shape[2], q_start, k_start):
        rows = q[:, :, first - q_start:end - q_start]
        if shape is None:  # these queries see none of the block: weighed as nothing by the merge
            outs.append(torch.zeros(rows.shape, dtype=torch.float32, device=q.device))
            lses.append(torch.full(rows.shape[:3], float("-inf"), device=q.device))
            continue
        out, lse = fused_partial(rows, k[:, :, :keys], v[:, :, :keys], scale=scale, shape=shape, q_start=first,
                                 k_start=k_start)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs, 2), torch.cat(lses, 2)


class SdpaAttention:
    """PyTorch scaled_dot_product_attention for whole views (decoding steps on the CPU: the
    kernel of triforce.kernels.cpu.attention.decode), the tiled torch kernel for partial attention.
    Works on every device and dtype."""

    name = "sdpa"
    cpu_kernel = True

    def attend(self, q, k, v, *, scale: float, sliding_window: int | None = None) -> torch.Tensor:
        return attention(q, k, v, scale=scale, sliding_window=sliding_window, cpu_kernel=self.cpu_kernel)

    def buffer_decoder(self, k_buf: torch.Tensor, v_buf: torch.Tensor, scale: float) -> BufferDecoder | None:
        """What writes and attends a cache's decoding steps over these buffers [L, B, Hkv, C, D]
        without `attend`'s views, where the CPU kernel takes them (None elsewhere)."""
        return BufferDecoder.over(k_buf, v_buf, scale) if self.cpu_kernel else None

    fused_partial_failed: str | None = None  # why the fused path was given up, if it was

    def partial(self, q, k, v, *, scale: float, q_start: int, k_start: int,
                sliding_window: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        shape = fused_shape(q, k.shape[2], q_start, k_start, sliding_window)
        if shape is None and sliding_window is None and k.shape[2] and fusable(q):
            shape = "pieces"  # keys past some queries: fused by piece, never the float32 tiles (a prefill's blocks)
        if shape is not None and self.fused_partial_failed is None:
            try:
                if shape == "pieces":
                    return _fused_pieces(q, k, v, scale, q_start, k_start)
                return fused_partial(q, k, v, scale=scale, shape=shape, q_start=q_start, k_start=k_start)
            except torch.OutOfMemoryError:
                raise  # memory, not a missing kernel: the tiled reference would need more
            except RuntimeError as e:  # a kernel this build or device lacks: the reference from now on
                self.fused_partial_failed = str(e).splitlines()[0] if str(e) else type(e).__name__
                print(f"note: fused partial attention unavailable ({self.fused_partial_failed}); "
                      "using the tiled reference", file=sys.stderr)
        return partial_attention(q, k, v, scale=scale, q_start=q_start, k_start=k_start,
                                 sliding_window=sliding_window)


    def fixed_reads_filled_only(self, k_cache: torch.Tensor) -> bool:
        """Whether attend_fixed over this buffer reads only its filled entries (else the whole
        capacity, masked: cheap for a sparse tier's few thousand slots, not for a full cache)."""
        return False

    def attend_fixed(self, q, k_cache, v_cache, k, v, *, slots: torch.Tensor, cache_seqlens: torch.Tensor,
                     visible: torch.Tensor, scale: float) -> torch.Tensor:
        """Fixed-shape attention for CUDA graphs. k_cache, v_cache [B, Hkv, C, D]: writes the new k, v
        ([B, Hkv, T, D]) at `slots` [T] (= cache_seqlens + 0..T-1; cache_seqlens int32 [B]) and
        attends q [B, H, T, D] over the entries `visible` [T, C] (slot j <= slot of query i)."""
        k_cache.index_copy_(2, slots, k)
        v_cache.index_copy_(2, slots, v)
        batch, heads, num_new, dim = q.shape
        kv_heads = k_cache.shape[1]
        groups = heads // kv_heads
        # fold the query heads sharing a KV head into rows: each K/V head is read once
        folded = q.reshape(batch, kv_heads, groups * num_new, dim)
        mask = visible.repeat(groups, 1)  # row g * T + t sees what query t sees
        out = F.scaled_dot_product_attention(folded, k_cache, v_cache, attn_mask=mask, scale=scale)
        return out.reshape(batch, heads, num_new, dim)


class SdpaReference(SdpaAttention):
    """PyTorch SDPA for every whole view, the CPU's decoding steps too: the reference the CPU
    kernel is compared with (tests, bench/vs_llamacpp.py's "reference kernels")."""

    name = "sdpa-reference"
    cpu_kernel = False


SDPA = SdpaAttention()


class FlashAttention(SdpaAttention):
    """flash-attn's kernel on CUDA half-precision tensors; anything it cannot take (float32/64,
    CPU tensors, a partial block whose mask is not plain causal) goes to the SDPA path.

    `flash_fn` has flash_attn_func's contract: q [B, T, H, D], k, v [B, S, Hkv, D] (last dim
    contiguous), causal masks bottom-right aligned, window_size=(left, right), and with
    return_attn_probs=True returns (out, lse [B, H, T], ...). `kvcache_fn` has
    flash_attn_with_kvcache's: it writes k, v into k_cache, v_cache [B, S, Hkv, D] at
    cache_seqlens (int32 [B]) and attends over the first cache_seqlens + T entries."""

    name = "flash"
    DTYPES = (torch.float16, torch.bfloat16)

    def __init__(self, flash_fn=None, kvcache_fn=None, cuda_only: bool = True):
        if flash_fn is None:
            from flash_attn import flash_attn_func as flash_fn
        if kvcache_fn is None:
            from flash_attn import flash_attn_with_kvcache as kvcache_fn
        self.flash_fn, self.kvcache_fn, self.cuda_only = flash_fn, kvcache_fn, cuda_only

    def _takes(self, q: torch.Tensor) -> bool:
        return q.dtype in self.DTYPES and (on_cuda(q) or not self.cuda_only)

    def _run(self, q, k, v, scale, causal, window, lse):
        result = self.flash_fn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), softmax_scale=scale,
                               causal=causal, window_size=window, return_attn_probs=lse)
        if lse:
            return result[0].transpose(1, 2), result[1]
        return result.transpose(1, 2)

    def attend(self, q, k, v, *, scale: float, sliding_window: int | None = None) -> torch.Tensor:
        if not self._takes(q):
            return super().attend(q, k, v, scale=scale, sliding_window=sliding_window)
        window = (-1, -1) if sliding_window is None else (sliding_window - 1, 0)
        return self._run(q, k, v, scale, True, window, False)

    def fixed_reads_filled_only(self, k_cache: torch.Tensor) -> bool:
        return self._takes(k_cache)  # its kv-cache kernel stops at cache_seqlens

    def attend_fixed(self, q, k_cache, v_cache, k, v, *, slots: torch.Tensor, cache_seqlens: torch.Tensor,
                     visible: torch.Tensor, scale: float) -> torch.Tensor:
        """flash-attn's kv-cache kernel: it appends k, v itself and reads only the valid entries."""
        if not self._takes(q):
            return super().attend_fixed(q, k_cache, v_cache, k, v, slots=slots, cache_seqlens=cache_seqlens,
                                        visible=visible, scale=scale)
        out = self.kvcache_fn(q.transpose(1, 2), k_cache.transpose(1, 2), v_cache.transpose(1, 2),
                              k=k.transpose(1, 2), v=v.transpose(1, 2), cache_seqlens=cache_seqlens,
                              softmax_scale=scale, causal=True)
        return out.transpose(1, 2)

    def partial(self, q, k, v, *, scale: float, q_start: int, k_start: int,
                sliding_window: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        kind = block_kind(q.shape[2], k.shape[2], q_start, k_start, sliding_window)
        if not self._takes(q) or kind is None:
            return super().partial(q, k, v, scale=scale, q_start=q_start, k_start=k_start,
                                   sliding_window=sliding_window)
        out, lse = self._run(q, k, v, scale, kind == "diagonal", (-1, -1), True)
        return out.float(), lse.float()


ATTN_CHOICES = ("auto", "flash", "sdpa", "sdpa-reference")


def select_attention(choice: str, device: torch.device) -> tuple[SdpaAttention, str]:
    """`--attn auto|flash|sdpa|sdpa-reference` -> (backend, a line saying what was chosen and
    why). auto takes flash-attn on CUDA when it is importable."""
    if choice not in ATTN_CHOICES:
        raise ValueError(f"unknown attention backend '{choice}' (choose {', '.join(ATTN_CHOICES)})")
    if choice == "sdpa-reference":
        return SdpaReference(), "attention: PyTorch SDPA for every step (--attn sdpa-reference)"
    if choice == "sdpa":
        return SDPA, "attention: PyTorch SDPA (--attn sdpa)"
    if choice == "auto" and torch.device(device).type != "cuda":  # flash-attn is no choice here: say nothing of it
        return SDPA, "attention: the CPU kernels (PyTorch SDPA for long passes)"
    try:
        backend = FlashAttention()
    except ImportError as e:
        if choice == "flash":
            raise ValueError(f"--attn flash needs flash-attn, which cannot be imported ({e}); "
                             "install it with pip install 'triforce[flash]' or use --attn sdpa") from None
        return SDPA, "attention: PyTorch SDPA (flash-attn not installed)"
    if torch.device(device).type != "cuda":
        if choice == "flash":
            raise ValueError("--attn flash runs on CUDA only; on this device use --attn sdpa")
        return SDPA, "attention: PyTorch SDPA (flash-attn needs CUDA)"
    return backend, "attention: flash-attn (half-precision tensors; SDPA for the rest)"
