"""Device kernels: attention over a KV view (flash-attn, PyTorch SDPA, or on the CPU decoding's
few-query kernel), the CPU's small-rows linear layers, partial attention with
log-sum-exp for merging streamed blocks, and the retrieval cache's scoring, top-k and gather."""
from triforce.kernels.attention import (SDPA, FlashAttention, SdpaAttention, SdpaReference, attention, causal_mask,
                                        select_attention)
from triforce.kernels.partial import PartialAccumulator, block_visible, merge_partials, partial_attention
from triforce.kernels.retrieval import (TORCH_KERNELS, RetrievalKernels, chunk_mean_keys, gather_into,
                                        grouped_scores, topk_sorted)

__all__ = ["attention", "causal_mask", "partial_attention", "merge_partials", "PartialAccumulator",
           "block_visible", "chunk_mean_keys", "grouped_scores", "topk_sorted", "gather_into",
           "RetrievalKernels", "TORCH_KERNELS", "SDPA", "SdpaAttention", "SdpaReference", "FlashAttention", "select_attention"]
