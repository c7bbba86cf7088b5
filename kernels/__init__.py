"""Device kernels: attention over a KV view (PyTorch SDPA reference path), partial attention
with log-sum-exp for merging streamed blocks."""
from triforce.kernels.attention import attention, causal_mask
from triforce.kernels.retrieval import (TORCH_KERNELS, RetrievalKernels, chunk_mean_keys, gather_into,
                                        grouped_scores, topk_sorted)
from triforce.kernels.partial import PartialAccumulator, block_visible, merge_partials, partial_attention

__all__ = ["attention", "causal_mask", "partial_attention", "merge_partials", "PartialAccumulator",
           "block_visible", "chunk_mean_keys", "grouped_scores", "topk_sorted", "gather_into",
           "RetrievalKernels", "TORCH_KERNELS"]
