"""A loaded model's projections (and tied embeddings) as block-quantized weights: the GGUF file's
own blocks (`--quantize gguf`), or the float weights quantized at load time (`--quantize q8_0 |
q4_0 | q4_1 | q4_k`, llama.cpp's reference quantizers through the gguf package; Q4_K's is
triforce.kernels.cpu.linear.q4_k's). A matrix whose rows are not whole Q4_K super-blocks (256
weights) is quantized as q4_1 instead, as llama.cpp falls back for such rows; a file's tensors in
formats without block kernels (Q5_0, Q5_K, F16, ...) stay float, de-quantized from the file; Q6_K
tensors run as blocks too (read from files only: the gguf package cannot make them).

Each nn.Linear of the decoder becomes a QuantizedLinear holding a BlockWeight (on a GPU: its
DeviceBlocks copy); its forward is the reference (de-quantize, then F.linear), and
`use_kernels("fused")` builds the block kernels (triforce.kernels.cpu.linear.blocks; on a GPU
triforce.kernels.cuda.quant_triton) over q/k/v and gate/up stacked, as for float weights. Norms
stay float. A converted GGUF folder never makes its blocks' weights float (they stay on the meta
device until the blocks replace them), its rows put in order as triforce.model.gguf_weights does
for floats (Llama files store q and k rows permuted for their RoPE layout); given float weights
instead, the blocks are matched to them by exact equality after de-quantizing, the row order
found, and anything that does not match is refused rather than run."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import torch
from torch import nn

from triforce.errors import UserError
from triforce.kernels.cpu.linear.block_formats import FORMATS, BlockWeight, format_of, whole_blocks
from triforce.model.gguf_index import gguf_tensors
from triforce.model.gguf_weights import PROJECTIONS as _PROJECTIONS, file_matrix, hf_name, matrix_names, part_rows
from triforce.model.quantized_layers import QuantizedEmbedding, QuantizedLinear

CHOICES = (*FORMATS, "gguf")


def _check_asked(kind: str, on_gpu: bool, gguf_path: Path | None) -> None:
    if kind not in CHOICES:
        raise UserError(f"unknown --quantize '{kind}' (choose from {', '.join(CHOICES)})")
    if on_gpu and importlib.util.find_spec("triton") is None:
        raise UserError("--quantize on a GPU runs Triton kernels: install triton (pip install triton)")
    if kind == "gguf" and gguf_path is None:
        raise UserError("--quantize gguf needs a model loaded from a .gguf file (the default model is one)")


def quantize_model(model, kind: str, gguf_path: Path | None = None, required: bool = True,
                   device: torch.device | None = None, row_order=None, architecture: str = "llama") -> dict | None:
    """Replace `model`'s projections (and its tied or untied embeddings and head) by block
    weights of format `kind`, or with kind 'gguf' by the file's own blocks. Returns what was
    done: {"weights": format per tensor kind, "bytes": block bytes, "file_bytes": their GGUF size,
    "block_weights": how many weights they hold}.
    required False: a file with no tensor in a block format leaves the model as it is (None).
    device: where the model runs; a GPU gets the blocks as DeviceBlocks for the Triton kernels
    (the model is quantized on the CPU, then moved).
    row_order: the GgufSource.row_order of a converted folder, for weights left on the meta
    device (never made float: see block_parameters); architecture: the file's (Phi-3 fuses matrices)."""
    on_gpu = device is not None and device.type != "cpu"
    _check_asked(kind, on_gpu, gguf_path)
    source = _GgufBlocks(gguf_path, row_order, architecture) if kind == "gguf" else None
    if source is not None and not source.any_blocks(len(model.model.layers)):
        if not required:
            return None
        raise UserError(f"{gguf_path.name} holds no tensor in a block format that runs as blocks "
                        f"({', '.join(FORMATS)}); use --quantize q8_0 or q4_k")
    dtype = model.lm_head.weight.dtype if isinstance(model.lm_head, nn.Linear) else torch.float32
    made: list[BlockWeight] = []

    def blocks_for(gguf_name: str, weight: torch.Tensor, heads: int | None = None) -> BlockWeight | None:
        """The blocks of one matrix; None: it stays float (a file's tensor in another format)."""
        if source is not None:
            block = source.block(gguf_name, weight, heads, k_factors=on_gpu)
        else:
            fits = whole_blocks(kind, weight.shape[1])
            block = BlockWeight.quantize(kind if fits else "q4_1", weight, k_factors=on_gpu)
        if block is not None:
            made.append(block)
        return block

    cfg = model.config
    for i, layer in enumerate(model.model.layers):
        for short, path in _PROJECTIONS.items():
            owner_name, _, attr = path.rpartition(".")
            owner = layer.get_submodule(owner_name)
            linear = getattr(owner, attr)
            heads = cfg.num_heads if short == "attn_q" else cfg.num_kv_heads if short == "attn_k" else None
            block = blocks_for(f"blk.{i}.{short}.weight", linear.weight, heads)
            if block is not None:
                setattr(owner, attr, QuantizedLinear(block, linear.bias))
        layer.fuse(False)
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    embed = blocks_for("token_embd.weight", model.model.embed_tokens.weight)
    head = embed if tied else blocks_for("output.weight", model.lm_head.weight)
    if embed is not None:
        model.model.embed_tokens = QuantizedEmbedding(embed, dtype)
    if head is not None:
        model.lm_head = QuantizedLinear(head, None)
    if on_gpu:
        made = _blocks_to(model, device)
    model.use_kernels("fused")
    kinds = sorted({b.kind for b in made})
    return {"weights": "/".join(kinds), "bytes": sum(b.nbytes for b in made),
            "file_bytes": sum(b.file_nbytes for b in made), "block_weights": sum(b.rows * b.cols for b in made)}


def held_file_blocks(gguf_path: Path, cfg, dtype_bytes: int) -> tuple[str, float] | None:
    """What a run of the GGUF file's own blocks holds (`--quantize auto` on a CPU), without loading
    it: each matrix as the CPU kernels hold its format, the file's other formats as floats in the
    run's dtype. (formats, bytes of the matrices); None where no matrix is in a block format."""
    from triforce.kernels.cpu.linear.block_formats import BLOCK, HELD_BYTES

    tensors = gguf_tensors(gguf_path)
    names = {file_matrix(n, cfg.model_type)[0]: None for n in matrix_names(cfg.num_layers)}  # a fused one once
    kinds, held = set(), 0.0
    for name in (n for n in names if n in tensors):
        weights = int(np.prod(tensors[name].shape))
        kind = format_of(tensors[name].tensor_type)
        kinds |= {kind} if kind else set()
        held += weights * HELD_BYTES[kind] / BLOCK if kind else weights * dtype_bytes
    return ("/".join(sorted(kinds)), held) if kinds else None


def block_parameters(source, layers: int) -> frozenset[str]:
    """The decoder parameters whose tensors in the GGUF file `source` (a GgufSource) run as blocks."""
    tensors = gguf_tensors(source.path)
    held = [(n, file_matrix(n, source.architecture)[0]) for n in matrix_names(layers)]
    return frozenset(hf_name(n) for n, f in held if f in tensors and format_of(tensors[f].tensor_type))


def random_blocks_into(model, kind: str, device: torch.device, generator: torch.Generator) -> dict:
    """Replace the projections and head of a random-weight model (still on the meta device) by
    random blocks of format `kind` made on `device` (DeviceBlocks on a GPU): timing a big
    architecture in blocks without making (or quantizing) its float weights. Quants uniform,
    scales so the weights spread about as std 0.02. The embedding stays float (a lookup)."""
    if kind not in FORMATS:
        raise UserError(f"random-weight architectures take --quantize {' / '.join(FORMATS)}, not '{kind}'")
    made = []

    def replace(linear: nn.Linear) -> QuantizedLinear:
        rows, cols = linear.weight.shape
        if not whole_blocks("q4_1", cols):
            raise UserError(f"--quantize {kind}: rows of {cols} weights are not whole 32-weight blocks")
        block = random_block(kind if whole_blocks(kind, cols) else "q4_1", rows, cols, device, generator)
        made.append(block)
        return QuantizedLinear(block, linear.bias)

    for layer in model.model.layers:
        for path in _PROJECTIONS.values():
            owner_name, _, attr = path.rpartition(".")
            owner = layer.get_submodule(owner_name)
            setattr(owner, attr, replace(getattr(owner, attr)))
    model.lm_head = replace(model.lm_head)
    return {"weights": "/".join(sorted({b.kind for b in made})), "bytes": sum(b.nbytes for b in made),
            "file_bytes": sum(b.file_nbytes for b in made), "block_weights": sum(b.rows * b.cols for b in made)}


def random_block(kind: str, rows: int, cols: int, device: torch.device, generator: torch.Generator):
    """Random blocks made on `device`, weights about std 0.02: DeviceBlocks on a GPU; on the CPU
    the same blocks as a BlockWeight, their scales (and offsets) widened to float32 as it holds them."""
    blocks = _random_device_block(kind, rows, cols, device, generator)
    if device.type != "cpu":
        return blocks
    scales, offsets = blocks.block_scales()
    offsets = np.zeros((rows, 0), np.float32) if offsets is None else offsets.numpy()
    quants = blocks.quant_values() if kind == "q6_k" else blocks.quants  # BlockWeight's q6_k: q - 32 a byte
    return BlockWeight(kind, rows, cols, quants.numpy(), scales.numpy(), offsets)


def _random_device_block(kind: str, rows: int, cols: int, device: torch.device, generator: torch.Generator):
    """DeviceBlocks' own layout (float16 scales; Q4_K's sc, m and per-256 d, dmin; Q6_K's nibbles,
    bit pairs, int8 sc and per-256 d), std ~0.02."""
    from triforce.kernels.cuda.device_blocks import DeviceBlocks

    blocks = cols // 32
    no_supers = torch.zeros(rows, 0, 2, device=device)
    if kind == "q6_k":  # sc ~ 40, q - 32 ~ 0 +- 18.5: d = 0.02 / (40 * 18.5)
        low = torch.randint(0, 256, (rows, cols // 2), device=device, dtype=torch.uint8, generator=generator)
        high = torch.randint(0, 256, (rows, cols // 4), device=device, dtype=torch.uint8, generator=generator)
        sc = torch.randint(16, 64, (rows, cols // 16), device=device, dtype=torch.int8, generator=generator)
        d = torch.full((rows, cols // 256, 1), 0.02 / (40 * 18.5), device=device)
        return DeviceBlocks(kind, rows, cols, low, sc, high, d)
    if kind == "q8_0":
        quants = torch.randint(-127, 128, (rows, cols), device=device, dtype=torch.int8, generator=generator)
        scales = torch.empty(rows, blocks, device=device).uniform_(0.5, 1.5, generator=generator) * (0.02 / 73)
        return DeviceBlocks(kind, rows, cols, quants, scales.half(), torch.empty(rows, 0, device=device).half(),
                            no_supers)
    quants = torch.randint(0, 256, (rows, cols // 2), device=device, dtype=torch.uint8, generator=generator)
    if kind == "q4_k":  # sc ~ 40, q ~ 7.5 +- 4.6, m ~ 31.5: d = 0.02 / (40 * 4.6), dmin centres the weights
        sc = torch.randint(16, 64, (rows, blocks), device=device, dtype=torch.uint8, generator=generator)
        m = torch.randint(0, 64, (rows, blocks), device=device, dtype=torch.uint8, generator=generator)
        d = 0.02 / (40 * 4.6)
        supers = torch.tensor([d, d * 40 * 7.5 / 31.5], device=device).expand(rows, blocks // 8, 2).contiguous()
        return DeviceBlocks(kind, rows, cols, quants, sc, m, supers)
    scales = torch.empty(rows, blocks, device=device).uniform_(0.5, 1.5, generator=generator) * (0.02 / 4.6)
    offsets = torch.empty(rows, 0, device=device) if kind == "q4_0" else -7.5 * scales
    return DeviceBlocks(kind, rows, cols, quants, scales.half(), offsets.half(), no_supers)


def _blocks_to(model, device: torch.device) -> list:
    """The blocks copied to `device` as DeviceBlocks (a tied model's embedding and head keep
    sharing theirs), then the float rest of the model (norms, biases, a file's float tensors)."""
    from triforce.kernels.cuda.device_blocks import DeviceBlocks

    moved: dict[int, DeviceBlocks] = {}
    for module in model.modules():
        if isinstance(module, (QuantizedLinear, QuantizedEmbedding)):
            if id(module.block) not in moved:
                moved[id(module.block)] = DeviceBlocks.of(module.block, device)
            module.block = moved[id(module.block)]
    model.to(device)
    return list(moved.values())


class _GgufBlocks:
    """The block tensors of a GGUF file, each checked against the float weight it should be."""

    def __init__(self, path: Path, row_order=None, architecture: str = "llama"):
        self.path = path
        self.tensors = gguf_tensors(path)
        self.row_order = row_order  # GgufSource.row_order, for weights never made float
        self.architecture = architecture

    def any_blocks(self, layers: int) -> bool:
        """Whether a tensor a model of `layers` layers takes from the file is in FORMATS."""
        names = {file_matrix(n, self.architecture)[0] for n in matrix_names(layers)}
        return any(n in self.tensors and format_of(self.tensors[n].tensor_type) for n in names)

    def block(self, name: str, weight: torch.Tensor, heads: int | None, k_factors: bool = False) -> BlockWeight | None:
        """None where the file's tensor is in another format (it stays float).
        k_factors: keep a Q4_K or Q6_K tensor's own factors (BlockWeight.from_raw)."""
        stored, part, parts = file_matrix(name, self.architecture)
        tensor = self.tensors.get(stored)
        if tensor is None:
            raise UserError(f"{self.path.name} has no tensor '{stored}' for --quantize gguf")
        kind = format_of(tensor.tensor_type)
        if kind is None:
            return None
        rows, cols = weight.shape
        total = int(np.prod(tensor.shape)) // cols  # a fused matrix's rows (GGUF shapes list columns first)
        block = BlockWeight.from_raw(kind, np.asarray(tensor.data), total, cols, k_factors)
        if parts > 1:  # this matrix's rows of the file's fused one
            block = block.permute_rows(part_rows(part, parts, rows, total))
        factors = [block.scales, block.offsets, *(block.k_factors or ())]
        if not all(np.isfinite(f).all() for f in factors if f.dtype.kind == "f"):
            raise UserError(f"tensor '{name}' in {self.path.name} has NaN or infinite block scales: the "
                                   "weights are broken (re-download the file)")
        if weight.is_meta:  # never made float: the rows in the order the floats would take
            order = self.row_order(name, rows)
            return block if order is None else block.permute_rows(order)
        # compared in the loaded weight's dtype: a bfloat16 load (--dtype auto on a CPU with native
        # bfloat16) holds the de-quantized float32 values rounded once, as .to() rounds the blocks'
        expected = weight.detach()
        for order in _row_orders(rows, heads):
            candidate = block if order is None else block.permute_rows(order)
            if torch.equal(candidate.dequantized().to(expected.dtype), expected):
                return candidate
        raise UserError(f"{self.path.name}: tensor '{name}' does not de-quantize to the model's float weight; "
                        "the file and the weights given disagree")


def _row_orders(rows: int, heads: int | None):
    """The file's row order as it is, then (q and k of Llama files) with each head's two RoPE
    halves interleaved back, as transformers' GGUF loader reverses llama.cpp's permutation."""
    yield None
    if heads:
        dim = rows // heads // 2
        yield np.arange(rows).reshape(heads, dim, 2).swapaxes(1, 2).reshape(-1)
