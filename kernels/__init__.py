"""Device kernels: attention over a KV view (PyTorch SDPA reference path), partial attention
with log-sum-exp for merging streamed blocks."""
from triforce.kernels.attention import attention, causal_mask
from triforce.kernels.retrieval import chunk_mean_keys, grouped_scores
from triforce.kernels.partial import PartialAccumulator, block_visible, merge_partials, partial_attention

__all__ = ["attention", "causal_mask", "partial_attention", "merge_partials", "PartialAccumulator",
           "block_visible", "chunk_mean_keys", "grouped_scores"]
