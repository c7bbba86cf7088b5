"""Build a model on the meta device and fill it tensor by tensor from a Hugging Face folder
(safetensors or PyTorch .bin, single file or sharded) or the GGUF file a converted folder names
(triforce.model.gguf_weights), so no second copy is ever held."""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Iterator

import torch
from torch import nn

from triforce.errors import DamagedFileError, UserError
from triforce.paths import read_small

# Phi-3 checkpoints fuse these projections (split_fused)
_FUSED = re.compile(r"(.*\.)(self_attn\.qkv_proj|mlp\.gate_up_proj)(\..*)")
# Buffers some checkpoints carry that the model recomputes.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# Multimodal checkpoints (Gemma 3 4B and up) hold the language model under a prefix (the hub's, then
# transformers 5's), beside a vision tower and projector that a text run leaves unread
_TEXT_PREFIXES = (("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."),
                  ("model.language_model.", "model."))
_VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


def text_model_name(name: str) -> str | None:
    """The decoder's name for a checkpoint tensor; None for a multimodal model's vision parts."""
    if name.startswith(_VISION_PREFIXES):
        return None
    for prefix, ours in _TEXT_PREFIXES:
        if name.startswith(prefix):
            return ours + name[len(prefix):]
    return name


def weight_files(folder: Path) -> list[Path]:
    from triforce.model.gguf_weights import SOURCE

    if (folder / SOURCE).exists():
        return [folder / SOURCE]
    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        index = folder / index_name
        if index.exists():
            try:
                weight_map = json.loads(read_small(index, "the shard index"))["weight_map"]
                names = list(weight_map.values())
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                raise UserError(f"cannot read shard index {index}: {e}") from None
            if not all(isinstance(n, str) and Path(n).name == n and n not in (".", "..") for n in names):
                raise UserError(f"{index} names shards outside its folder (a shard is a file name, no path)")
            files = sorted({folder / name for name in names})
            missing = [f.name for f in files if not f.exists()]
            if missing:
                raise UserError(f"{index} names shards that are missing: {', '.join(missing)}")
            return files
    for single in ("model.safetensors", "pytorch_model.bin"):
        if (folder / single).exists():
            return [folder / single]
    files = sorted(folder.glob("*.safetensors"))
    if files:
        return files
    raise UserError(f"no weights in {folder} (looked for *.safetensors and pytorch_model.bin)")


def iter_tensors(path: Path, skip: frozenset[str] = frozenset()) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) one at a time; a damaged file becomes a UserError. skip: names a
    GGUF source does not read (they run as the file's blocks)."""
    from triforce.model.gguf_weights import SOURCE, iter_gguf_tensors

    if path.name == SOURCE:
        yield from iter_gguf_tensors(path, skip)
        return
    try:
        if path.suffix == ".safetensors":
            from safetensors import safe_open
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        else:
            state = _load_bin(path)
            for name in list(state):
                yield name, state.pop(name)
    except UserError:
        raise
    except Exception as e:  # safetensors, pickle and zip errors have no common base
        raise DamagedFileError(f"cannot read weights file {path} (corrupt or truncated?): "
                        f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None


def _load_bin(path: Path) -> dict:
    """A PyTorch .bin: only the zip format, and only tensors (weights_only): anything else would
    have to run pickle code from the file, so it is refused by name, not called corrupt."""
    import pickle
    import zipfile

    unsafe = (f"{path} is not a safe checkpoint format ({{}}); triforce does not load it: convert it to "
              "safetensors with a tool you trust")
    if not zipfile.is_zipfile(path):
        raise UserError(unsafe.format("a legacy PyTorch pickle, not the zip format"))
    try:
        return torch.load(str(path), map_location="cpu", mmap=True, weights_only=True)
    except pickle.UnpicklingError:
        raise UserError(unsafe.format("it holds Python objects besides tensors")) from None


LAYER_TENSORS = 6  # the fewest a decoder layer holds: Phi-3's q/k/v and gate/up in one matrix each, o, down, 2 norms


def split_fused(name: str, tensor: torch.Tensor, cfg) -> Iterator[tuple[str, torch.Tensor]]:
    """Phi-3's fused projections as the separate ones the decoder holds (it fuses them again
    itself, in the order and layout that suit its kernels): qkv_proj's rows are q, k, v;
    gate_up_proj's the gate, then up. Views, so nothing is copied."""
    match = _FUSED.fullmatch(name)
    if match is None:
        yield name, tensor
        return
    stem, fused, suffix = match.groups()
    if fused == "self_attn.qkv_proj":
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        parts, rows = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), [q, kv, kv]
    else:
        parts, rows = ("mlp.gate_proj", "mlp.up_proj"), [cfg.intermediate_size] * 2
    if tensor.shape[0] != sum(rows):
        raise UserError(f"tensor '{name}' has {tensor.shape[0]} rows; the config implies {sum(rows)} "
                        f"({', '.join(p.rpartition('.')[2] for p in parts)})")
    for part, piece in zip(parts, tensor.split(rows)):
        yield f"{stem}{part}{suffix}", piece


def check_layer_count(layers: int, files: list[Path]) -> None:
    """A config claiming more layers than its weights could hold is refused before a model that
    size is built (a million claimed layers took 30 s and 2 GB to fail)."""
    from triforce.model.gguf_weights import SOURCE

    count = 0
    for path in files:
        if path.name == SOURCE:
            from triforce.model.gguf_index import gguf_tensors
            from triforce.model.gguf_weights import GgufSource
            count += len(gguf_tensors(GgufSource.read(path.parent).path))
        elif path.suffix == ".safetensors":
            from safetensors import safe_open
            try:
                with safe_open(str(path), framework="pt") as f:
                    count += len(list(f.keys()))
            except Exception:  # a damaged file: reading its tensors names it
                return
        else:
            return  # a .bin lists its tensors only by loading them
    if layers * LAYER_TENSORS > count:
        raise UserError(f"the model's config claims {layers:,} layers but its weights hold {count:,} tensors "
                        f"(a layer takes at least {LAYER_TENSORS}): the config is wrong")


def check_finite(tensor: torch.Tensor, name: str, where: str) -> None:
    """Weights holding NaN or infinity end the load with one line naming the tensor (a kernel
    would otherwise fail deep inside, or every token would be garbage)."""
    if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
        bad = int((~torch.isfinite(tensor)).sum())
        raise UserError(f"tensor '{name}' in {where} holds {bad:,} NaN or infinite value(s) of "
                        f"{tensor.numel():,}: the weights are broken (re-download or re-convert the model)")


def load_into(model: nn.Module, files: list[Path], dtype: torch.dtype, device, slicer=None,
              skip: frozenset[str] = frozenset(), checkpoint=None) -> None:
    """Assign every checkpoint tensor to the meta-built `model`, cast to dtype on `device`.
    slicer(name, tensor) -> the part this process keeps (tensor parallelism), cut on the host
    before anything reaches the device; None drops the tensor. skip: parameters left on the meta
    device (in `dtype`) for the caller to replace (a GGUF's block weights). checkpoint: the whole
    model's config where `model` is a rank's share (fused tensors are cut by the whole model's rows)."""
    params = dict(model.named_parameters())
    skip = frozenset(name for name in skip if name in params)
    for name in skip:
        module_name, _, attr = name.rpartition(".")
        meta = torch.empty(params[name].shape, dtype=dtype, device="meta")
        setattr(model.get_submodule(module_name), attr, nn.Parameter(meta, requires_grad=False))
    for path in files:
        for stored, whole in iter_tensors(path, skip):
            text_name = text_model_name(stored)
            if text_name is None:
                continue
            for name, tensor in split_fused(text_name, whole, checkpoint or model.config):
                if name.endswith(_IGNORED_SUFFIXES):
                    continue
                if slicer is not None:
                    tensor = slicer(name, tensor)
                    if tensor is None:
                        continue
                if name not in params:
                    raise UserError(f"{path.name} holds an unexpected tensor '{name}' "
                                    "(is this a supported Llama/Mistral/Qwen/Phi-3/Gemma 3 checkpoint?)")
                target = params[name]
                if tuple(tensor.shape) != tuple(target.shape):
                    raise UserError(f"tensor '{name}' in {path.name} has shape {tuple(tensor.shape)}, "
                                    f"the config implies {tuple(target.shape)}")
                check_finite(tensor, stored, path.name)  # the file's name for it, fused or not
                module_name, _, attr = name.rpartition(".")
                value = tensor.to(device=device, dtype=dtype)
                setattr(model.get_submodule(module_name), attr, nn.Parameter(value, requires_grad=False))
    model.tie_weights()
    missing = [n for n, p in model.named_parameters() if p.is_meta and n not in skip]
    if missing:
        raise UserError(f"checkpoint lacks {len(missing)} tensors, e.g. '{missing[0]}' "
                        "(truncated or incomplete download?)")
