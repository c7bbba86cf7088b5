"""Building the retrieval cache: mean keys of fixed-size chunks, their scores against a query
(summed over the query heads that share a KV head), top-k of the scores, and the gather of the
chosen tokens' KV. The torch functions here are the reference path; `RetrievalKernels` runs the
Triton versions (retrieval_triton.py) on CUDA when triton is importable."""
from __future__ import annotations

import importlib.util
import sys

import torch


def grouped_scores(query: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """query: [B, H, D], keys: [B, Hkv, N, D] -> [B, Hkv, N] float32 (float64 stays float64):
    q.k summed over the query heads that share each KV head (GQA)."""
    batch, heads, dim = query.shape
    groups = heads // keys.shape[1]
    calc = torch.float64 if keys.dtype == torch.float64 else torch.float32  # as the Triton kernel
    q = query.reshape(batch, keys.shape[1], groups, dim).to(calc)
    return torch.einsum("bhgd,bhnd->bhn", q, keys.to(calc))


def chunk_mean_keys(keys: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """keys: [B, Hkv, S, D] -> mean key of each complete chunk [B, Hkv, S // chunk_size, D]."""
    batch, kv_heads, length, dim = keys.shape
    num_chunks = length // chunk_size
    return keys[:, :, :num_chunks * chunk_size].reshape(batch, kv_heads, num_chunks, chunk_size, dim).mean(-2)


def topk_sorted(scores: torch.Tensor, k: int) -> torch.Tensor:
    """scores [..., N] -> int64 [..., k]: indices of the k largest, ascending; ties go to the
    lower index (so every implementation picks the same set)."""
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]
    return torch.sort(order, dim=-1).values


def gather_into(k_src: torch.Tensor, v_src: torch.Tensor, index: torch.Tensor,
                k_dst: torch.Tensor, v_dst: torch.Tensor) -> None:
    """k_dst[b, h, i] = k_src[b, h, index[b, h, i]] (and v). src [B, Hkv, S, D], index [B, Hkv, N]."""
    expanded = index[..., None].expand(-1, -1, -1, k_src.shape[-1])
    k_dst.copy_(torch.gather(k_src, 2, expanded))
    v_dst.copy_(torch.gather(v_src, 2, expanded))


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def _is_kernel_failure(e: Exception) -> bool:
    """A Triton compile, launch or driver failure (the reference can take over), not a bug in
    the calling code (TypeError, IndexError, ...), which must surface."""
    return type(e).__module__.startswith("triton") or isinstance(e, (RuntimeError, ImportError, OSError))


TRITON_KERNELS = ("chunk scoring", "gather")


class RetrievalKernels:
    """The scoring and gather a retrieval rebuild runs: Triton or the torch reference (top-k is
    always a device sort). A Triton kernel whose first call fails to compile or launch hands that
    kernel over to its reference, with a note; other errors are raised."""

    def __init__(self, use_triton: bool):
        self.use_triton = use_triton
        self._proven: set[str] = set()  # Triton kernels that have run once
        self.failed: set[str] = set()   # Triton kernels handed over to their reference
        if use_triton:
            import triforce.kernels.cuda.retrieval_triton as retrieval_triton
            self._triton = retrieval_triton

    def _run(self, name: str, run_triton, run_torch):
        if not self.use_triton or name in self.failed:
            return run_torch()
        if name in self._proven:
            return run_triton()
        try:
            result = run_triton()
        except Exception as e:  # noqa: BLE001
            if not _is_kernel_failure(e):
                raise
            self.failed.add(name)
            print(f"note: the Triton {name} kernel failed ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
                  "using the torch reference for it", file=sys.stderr)
            return run_torch()
        self._proven.add(name)
        return result

    @classmethod
    def for_device(cls, device: torch.device | str) -> "RetrievalKernels":
        """Triton on CUDA when it is installed; the torch reference otherwise."""
        return cls(torch.device(device).type == "cuda" and triton_available())

    @property
    def name(self) -> str:
        if not self.use_triton or self.failed >= set(TRITON_KERNELS):
            return "torch"
        return "triton" if not self.failed else f"triton (torch {', '.join(sorted(self.failed))})"

    def scores(self, query: torch.Tensor, means: torch.Tensor) -> torch.Tensor:
        """query [B, H, D], chunk means [B, Hkv, N, D] -> [B, Hkv, N] float32."""
        return self._run("chunk scoring", lambda: self._triton.chunk_scores(query.contiguous(), means),
                         lambda: grouped_scores(query, means))

    def topk(self, scores: torch.Tensor, k: int) -> torch.Tensor:
        return topk_sorted(scores, k)

    def gather_into(self, k_src, v_src, index, k_dst, v_dst) -> None:
        self._run("gather", lambda: self._triton.gather_into(k_src, v_src, index.contiguous(), k_dst, v_dst),
                  lambda: gather_into(k_src, v_src, index, k_dst, v_dst))


TORCH_KERNELS = RetrievalKernels(False)
