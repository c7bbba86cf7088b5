"""The bytes a plan's buffers take per token, per prefill chunk and per query group: the
arithmetic the memory planner (plan.planner) adds up, from a model's shape, the speculation
settings, the context and the element size."""
from __future__ import annotations

from dataclasses import dataclass

from triforce.config import PREFILL_CHUNKS, PREFILL_GROUP, SpecParams
from triforce.config.model import ModelConfig
from triforce.offload.shapes import activation_bytes_per_token, kv_bytes_per_token_layer, kv_heads_share
from triforce.plan.blocks import align_up

MAX_SCORE_ELEMENTS = 1 << 22  # of a partial-attention tile (kernels/partial.py's, kept equal by a test: no torch here)


@dataclass(frozen=True)
class PlanSizes:
    """The bytes one plan's buffers take per token, per chunk and per query group."""
    model: ModelConfig
    spec: SpecParams
    context: int
    dtype_bytes: int
    tp: int

    @property
    def per_token_layer(self) -> int:
        return kv_bytes_per_token_layer(self.model, self.dtype_bytes, self.tp)

    @property
    def per_token(self) -> int:
        return self.per_token_layer * self.model.num_layers

    @property
    def heads(self) -> int:
        return kv_heads_share(self.model, self.tp) * (self.model.num_heads // self.model.num_kv_heads)

    @property
    def logits(self) -> int:
        return 2 * max(self.spec.gamma2 + 1, 1) * self.model.vocab_size * 4

    @property
    def gamma_bytes(self) -> int:
        """What a fit error blames on the gammas: the verify's logits and the sparse tiers' slots."""
        slots = 2 * (self.spec.gamma1 + self.spec.gamma2_range[1]) if self.spec.uses_sparse_cache else 0
        return self.logits + slots * self.per_token

    @property
    def means_per_token(self) -> int:
        """Mean keys of retrieval chunks, kept beside resident keys (triforce.kernels.chunk_means)."""
        retrieval = self.spec.uses_sparse_cache and self.spec.sparse_policy == "retrieval"
        return self.per_token // (2 * self.spec.chunk_size) if retrieval else 0

    def workspace(self, chunk: int) -> int:
        """A prefill chunk's activations, the verify's logits, a rebuild's gather; a prefill keeps
        every layer's queries of its last token (SnapKV: of its window) until the sparse cache is
        selected by them."""
        gather = 2 * self.spec.budget * self.per_token_layer if self.spec.uses_sparse_cache else 0
        queries = self.model.num_layers * self.heads * self.spec.selection_window * self.model.head_dim \
            * self.dtype_bytes if self.spec.uses_sparse_cache else 0
        return min(chunk, self.context) * activation_bytes_per_token(self.model, self.dtype_bytes, self.tp) \
            + self.logits + gather + queries

    def group_attention(self, group: int) -> int:
        """A layer-major query group: its queries and attention output (dtype), the running merge
        and one block's partial result (float32, or float64), and the largest score tile."""
        calc = 8 if self.dtype_bytes == 8 else 4
        queries = min(group, self.context)
        tile = min(MAX_SCORE_ELEMENTS, self.heads * queries * self.context) * calc
        return queries * self.heads * (self.model.head_dim * (2 * self.dtype_bytes + 2 * calc) + 2 * calc) + tile

    @property
    def prefill_scratch(self) -> int:
        """A layer-major prefill: every prompt token's hidden state, its RoPE angles, one layer's new KV."""
        m = self.model
        return self.context * (m.hidden_size + 2 * m.head_dim + self.per_token_layer // self.dtype_bytes) \
            * self.dtype_bytes

    def prefill_sizes(self):
        """(chunk, query group) from the largest down: a smaller group streams the host KV more
        often but is tried before a smaller chunk, which slows every projection."""
        for chunk in PREFILL_CHUNKS:
            group = min(align_up(self.context, chunk), max(chunk, PREFILL_GROUP // chunk * chunk))
            while True:
                yield chunk, group
                if group == chunk:
                    break
                group = max(chunk, group // 2 // chunk * chunk)
