"""The byte counts that follow from a model's shape (per GPU, for the rank with the largest share
under tensor parallelism). The planner takes the core's own configuration types: a ModelConfig
(loaded, or a named architecture's shapes) and SpecParams."""
from __future__ import annotations

from dataclasses import dataclass

from triforce.config import PREFILL_CHUNKS
from triforce.config.model import ModelConfig
from triforce.offload.errors import OffloadError


def largest_share(n: int, tp: int) -> int:
    return -(-n // tp)


def kv_heads_share(m: ModelConfig, tp: int) -> int:
    return largest_share(m.num_kv_heads, tp)


def activation_bytes_per_token(m: ModelConfig, dtype_bytes: int, tp: int = 1) -> int:
    """The live activations of one token in one layer's forward on one rank."""
    heads = kv_heads_share(m, tp) * (m.num_heads // m.num_kv_heads)
    return (6 * m.hidden_size + 2 * heads * m.head_dim + 3 * largest_share(m.intermediate_size, tp)) * dtype_bytes


def drafting_graph_pool(m: ModelConfig, spec, dtype_bytes: int, draft: ModelConfig | None = None,
                        draft_dtype_bytes: int | None = None, tp: int = 1) -> int:
    """The drafting tiers' graphs (a sparse tier's over the target, a draft model's): one per step
    length 1..longest, each keeping its [T, vocab] logits; the longest step's activations."""
    longest = spec.longest_graph_step
    logits_slots = longest * (longest + 1) // 2 * m.vocab_size
    pool = 0
    if spec.uses_sparse_cache:
        pool += logits_slots * dtype_bytes + longest * activation_bytes_per_token(m, dtype_bytes, tp)
    if draft is not None:
        element = draft_dtype_bytes or dtype_bytes
        pool += logits_slots * element + longest * activation_bytes_per_token(draft, element)
    return pool


def full_tier_graph_pool(m: ModelConfig, longest: int, sparse_tier: bool, dtype_bytes: int, tp: int = 1) -> int:
    """The full tier's graphs over a resident cache (decoding.full_tier.graphable): one per verify
    width 1..longest, each keeping its [T, vocab] logits and, where a sparse tier reads them, every
    layer's queries [H, T, D]; the widest pass's activations. None for sliding-window models."""
    if any(w is not None for w in m.sliding_windows):
        return 0
    heads = kv_heads_share(m, tp) * (m.num_heads // m.num_kv_heads)
    queries = m.num_layers * heads * m.head_dim if sparse_tier else 0
    rows = longest * (longest + 1) // 2
    return rows * (m.vocab_size + queries) * dtype_bytes + longest * activation_bytes_per_token(m, dtype_bytes, tp)


def weight_bytes(m: ModelConfig, dtype_bytes: int, tp: int = 1, matrix_bytes: float | None = None) -> int:
    """Parameter bytes on the rank with the largest share: attention split by whole KV heads
    (query heads follow their KV head), MLP by intermediate rows; embeddings, LM head and norms
    replicated. matrix_bytes: bytes per weight of the matrices (projections, embeddings, head)
    when they are block-quantized; norms and biases stay in dtype_bytes."""
    kvh = kv_heads_share(m, tp)
    qh = kvh * (m.num_heads // m.num_kv_heads)
    inter = largest_share(m.intermediate_size, tp)
    h, d = m.hidden_size, m.head_dim
    matrices = matrix_weights(m, tp)
    small = m.num_layers * ((qh * d + 2 * kvh * d) * m.qkv_bias + h * m.o_bias + (2 * inter + h) * m.mlp_bias + 2 * h)
    small += h
    if matrix_bytes is None:
        return (matrices + small) * dtype_bytes
    return int(round(matrices * matrix_bytes)) + small * dtype_bytes


def matrix_weights(m: ModelConfig, tp: int = 1) -> int:
    """Weights of the matrices (projections, embeddings, head) on the rank with the largest share."""
    kvh = kv_heads_share(m, tp)
    qh = kvh * (m.num_heads // m.num_kv_heads)
    h, d = m.hidden_size, m.head_dim
    per_layer = h * qh * d + 2 * h * kvh * d + qh * d * h + 3 * h * largest_share(m.intermediate_size, tp)
    return m.num_layers * per_layer + m.vocab_size * h * (1 if m.tie_word_embeddings else 2)


@dataclass(frozen=True)
class LoadedBlocks:
    """A loaded model's matrices as they are (triforce.model.quantized's report): some formats, maybe
    floats beside them, at a measured mean of bytes per weight."""
    name: str                 # e.g. "q4_1/q8_0"
    bytes_per_weight: float


def kv_bytes_per_token_layer(m: ModelConfig, dtype_bytes: int, tp: int = 1) -> int:
    """K and V of one token in one layer, on the rank with the most KV heads."""
    return 2 * kv_heads_share(m, tp) * m.head_dim * dtype_bytes


def block_bytes_per_weight(weights: "str | LoadedBlocks | None", on_gpu: bool) -> float | None:
    """Bytes per weight of block format `weights` (None: floats), as the kernels hold the blocks:
    the CPU's (quant_blocks.HELD_BYTES) or the GPU's Triton kernels' (DEVICE_BYTES)."""
    if weights is None or isinstance(weights, LoadedBlocks):
        return None if weights is None else weights.bytes_per_weight
    from triforce.kernels.cpu.linear.block_formats import BLOCK, DEVICE_BYTES, HELD_BYTES
    if weights not in HELD_BYTES:
        raise OffloadError(f"unknown weight format '{weights}' (one of {', '.join(HELD_BYTES)})")
    return (DEVICE_BYTES if on_gpu else HELD_BYTES)[weights] / BLOCK


MATMUL_WORKSPACE_BYTES = 32 << 20  # cuBLAS's per-stream workspace: 32 MiB on Hopper (cublasSetWorkspace's advice)


def matmul_workspaces(budget_bytes: int, graphs: bool, retrieval_tier: bool, draft_tier: bool,
                      block_sums: int = 0) -> int:
    """Bytes of the matrix products' scratch a run holds on a GPU (budget_bytes: its device budget,
    0 on a CPU): a cuBLAS workspace per stream that runs a matmul, the default stream and each
    graphed drafting tier's capture stream (triforce.decoding.graph_runner), and block_sums, the
    Triton block kernels' largest buffer of split sums (block_sums_bytes). Every card from 8 GiB
    up holds the full 32 MiB workspace each; a toy budget below that (the simulated cards' tests)
    a 1/256 share."""
    each = min(MATMUL_WORKSPACE_BYTES, budget_bytes // 256)
    return (1 + (int(retrieval_tier) + int(draft_tier) if graphs else 0)) * each + (block_sums if budget_bytes else 0)


def block_sums_bytes(m: ModelConfig, weights, tp: int = 1) -> int:
    """The Triton block kernels' largest buffer of split sums over this model's projections (every
    pass size a run takes, up to a prefill chunk); 0 for float weights."""
    if weights is None:
        return 0
    from triforce.kernels.cuda.quant_launch import GEMV_ROWS, SHORT_PASS, split_sums_bytes
    q, kv = kv_heads_share(m, tp) * (m.num_heads // m.num_kv_heads) * m.head_dim, kv_heads_share(m, tp) * m.head_dim
    h, f = m.hidden_size, largest_share(m.intermediate_size, tp)
    shapes = [(q, h), (kv, h), (q + 2 * kv, h), (h, q), (f, h), (2 * f, h), (h, f), (m.vocab_size, h)]
    return split_sums_bytes(shapes, (1, GEMV_ROWS, SHORT_PASS, PREFILL_CHUNKS[0]))


GATHER_GROUP_BYTES = 64 << 20  # host staging of one group of layers in a rebuild (one wait a group)


def gather_staging_bytes(per_layer: int, num_layers: int) -> int:
    """Pinned bytes a retrieval rebuild gathers host KV through: `per_layer` (the selected tokens'
    K and V of one layer) for each layer of the largest group (cache.offloaded.OffloadedKVCache.gather_layers)."""
    return min(num_layers, max(1, GATHER_GROUP_BYTES // max(per_layer, 1))) * per_layer
