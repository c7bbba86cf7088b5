"""A GGUF file's tensors under the Hugging Face names the decoder takes, read from the file itself.

A converted GGUF folder holds the config and tokenizer only, plus `gguf-source.json` naming the
file: weights run as the file's blocks where kernels exist (triforce.model.quantized), and
any float weight is de-quantized at load as transformers' GGUF loader does (the gguf package's
de-quantizers; Llama files' q and k rows put back from llama.cpp's RoPE layout), so no float
copy of the file is ever cached."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from triforce.errors import DamagedFileError, UserError
from triforce.paths import read_small

SOURCE = "gguf-source.json"
_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
PROJECTIONS = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
               "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
               "ffn_down": "mlp.down_proj"}  # a layer's matrices: GGUF name -> the decoder's module
_LAYER = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
          "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm", **PROJECTIONS}
# Gemma 3 norms the attention's and the MLP's outputs too: its "ffn_norm" is the MLP's input norm
_GEMMA3_LAYER = {**_LAYER, "ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm",
                 "post_ffw_norm": "post_feedforward_layernorm"}
# Phi-3 files keep Hugging Face's fused projections (split at load: triforce.model.weights.split_fused)
_PHI3_LAYER = {**_LAYER, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
_LAYERS = {"gemma3": _GEMMA3_LAYER, "phi3": _PHI3_LAYER}
# a decoder matrix that such a file fuses with others: (the file's matrix, which part of its rows, of how many)
FUSED_ROWS = {"phi3": {"attn_q": ("attn_qkv", 0, 3), "attn_k": ("attn_qkv", 1, 3), "attn_v": ("attn_qkv", 2, 3),
                       "ffn_gate": ("ffn_up", 0, 2), "ffn_up": ("ffn_up", 1, 2)}}
_PERMUTING = ("llama",)  # GGUF architectures whose q/k rows llama.cpp's converter permuted (Mistral is "llama")
# architectures whose norms llama.cpp's converter stored as 1 + weight (what Gemma's norms scale by)
_NORMS_PLUS_ONE = ("gemma3",)


@dataclass(frozen=True)
class GgufSource:
    """What a converted folder reads its weights from."""
    path: Path
    size: int
    mtime_ns: int
    permute_qk: bool  # Llama files: q and k rows in llama.cpp's RoPE layout
    heads: int
    kv_heads: int
    architecture: str = "llama"  # the file's (records written before it was kept name no Gemma)
    made_by: str = ""  # a digest of the conversion that wrote the folder (gguf_convert.conversion_digest)

    @classmethod
    def of(cls, gguf_path: Path, architecture: str, heads: int, kv_heads: int, made_by: str = "") -> "GgufSource":
        stat = gguf_path.stat()
        return cls(gguf_path.resolve(), stat.st_size, stat.st_mtime_ns, architecture in _PERMUTING, heads, kv_heads,
                   architecture, made_by)

    def write(self, folder: Path) -> None:
        fields = {**self.__dict__, "path": str(self.path)}
        (folder / SOURCE).write_text(json.dumps(fields, indent=1) + "\n")

    @classmethod
    def read(cls, folder: Path) -> "GgufSource | None":
        """None where the folder is not a converted GGUF."""
        try:
            if not (folder / SOURCE).exists():
                return None
            fields = json.loads(read_small(folder / SOURCE, "the record of a converted GGUF"))
        except (UserError, OSError, ValueError) as e:
            raise DamagedFileError(f"cannot read {folder / SOURCE}: {e}") from None
        return cls(Path(fields["path"]), fields["size"], fields["mtime_ns"], fields["permute_qk"],
                   fields["heads"], fields["kv_heads"], fields.get("architecture", "llama"), fields.get("made_by", ""))

    def changed(self) -> str | None:
        """Why the file is no longer the one converted (None: it is)."""
        try:
            stat = self.path.stat()
        except OSError:
            return f"{self.path} is gone"
        if (stat.st_size, stat.st_mtime_ns) != (self.size, self.mtime_ns):
            return f"{self.path} changed since it was converted"
        return None

    def row_order(self, gguf_name: str, rows: int) -> np.ndarray | None:
        """The permutation that puts a tensor's rows in the Hugging Face order (None: as stored):
        each head's two RoPE halves interleaved back, as transformers' GGUF loader does."""
        if not self.permute_qk or not (".attn_q." in gguf_name or ".attn_k." in gguf_name):
            return None
        heads = self.heads if ".attn_q." in gguf_name else self.kv_heads
        dim = rows // heads // 2
        return np.arange(rows).reshape(heads, dim, 2).swapaxes(1, 2).reshape(-1)


def file_matrix(name: str, architecture: str) -> tuple[str, int, int]:
    """The file's tensor that holds the decoder's matrix `name` (a matrix_names entry), which part
    of its rows, and of how many parts: (name, 0, 1) where the file keeps the matrix alone."""
    parts = name.split(".")
    fused = FUSED_ROWS.get(architecture, {}).get(parts[2]) if parts[0] == "blk" and len(parts) == 4 else None
    return (name, 0, 1) if fused is None else (f"blk.{parts[1]}.{fused[0]}.{parts[3]}", fused[1], fused[2])


def part_rows(index: int, parts: int, rows: int, total: int) -> np.ndarray:
    """Rows of part `index` (`rows` long) of a fused matrix of `total` rows: the first part starts
    at 0, the others end where the later ones begin (q, then k and v of equal size; gate, up)."""
    start = 0 if index == 0 else total - rows * (parts - index)
    return np.arange(start, start + rows)


def _fused_parameters(name: str, architecture: str) -> list[str]:
    """The decoder parameters a fused file matrix holds ([] for any other tensor)."""
    parts = name.split(".")
    if parts[0] != "blk" or len(parts) != 4:
        return []
    return [f"model.layers.{parts[1]}.{PROJECTIONS[short]}.{parts[3]}"
            for short, (fused, _, _) in FUSED_ROWS.get(architecture, {}).items() if fused == parts[2]]


def matrix_names(layers: int) -> list[str]:
    """The GGUF tensors a model of `layers` layers may hold as blocks: embeddings, head, projections."""
    return ["token_embd.weight", "output.weight"] + [f"blk.{i}.{short}.weight" for i in range(layers)
                                                     for short in PROJECTIONS]


def hf_name(gguf_name: str, architecture: str = "llama") -> str | None:
    """The decoder's parameter for a GGUF tensor (None: one it recomputes, e.g. rope_freqs)."""
    parts, layer = gguf_name.split("."), _LAYERS.get(architecture, _LAYER)
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in layer:
        return f"model.layers.{parts[1]}.{layer[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in _TOP:
        return f"{_TOP[parts[0]]}.{parts[1]}"
    return None


def gguf_name(hf: str, architecture: str = "llama") -> str:
    """The GGUF tensor that holds the decoder's parameter `hf`."""
    for short, long in _TOP.items():
        if hf.startswith(long + "."):
            return f"{short}.{hf.rsplit('.', 1)[1]}"
    _, _, index, rest = hf.split(".", 3)
    module, _, kind = rest.rpartition(".")
    short = next(s for s, long in _LAYERS.get(architecture, _LAYER).items() if long == module)
    return f"blk.{index}.{short}.{kind}"


def iter_gguf_tensors(source_file: Path, skip: frozenset[str] = frozenset()) -> Iterator[tuple[str, object]]:
    """(Hugging Face name, float32 tensor) for each tensor of the file `source_file` names,
    de-quantized one at a time; names in `skip` (weights run as blocks) are not read."""
    import torch
    from gguf import dequantize

    from triforce.model.gguf_index import gguf_tensors

    source = GgufSource.read(source_file.parent)
    problem = source.changed()
    if problem is not None:
        raise DamagedFileError(f"{problem}: the model in {source_file.parent} reads its weights from it")
    for name, tensor in gguf_tensors(source.path).items():
        target, parts = hf_name(name, source.architecture), _fused_parameters(name, source.architecture)
        if target is None or target in skip or (parts and all(p in skip for p in parts)):
            continue
        try:
            values = dequantize(np.asarray(tensor.data), tensor.tensor_type).reshape(tensor.shape[::-1])
        except Exception as e:  # numpy's errors for a short read have no common base
            raise DamagedFileError(f"cannot read tensor {name} of {source.path} (corrupt or truncated?): "
                                   f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
        order = source.row_order(name, values.shape[0])
        if order is not None:
            values = values[order]
        if source.architecture in _NORMS_PLUS_ONE and name.endswith("norm.weight"):
            values = values - np.float32(1)
        values = np.ascontiguousarray(values)
        yield target, torch.from_numpy(values if values.flags.writeable else values.copy())  # F32: a file view
