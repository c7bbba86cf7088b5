"""Turn a GGUF file into a cached Hugging Face folder (config, tokenizer, float32 safetensors).

Dequantising through transformers takes tens of seconds; doing it once and keeping the result
makes every later start fast. The file's header is checked first (readable, a supported
architecture, room in the cache folder), and a conversion that would leave any tensor at its
random initial value is refused, so nothing wrong is ever cached."""
from __future__ import annotations

import errno
import hashlib
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from triforce.errors import UserError
from triforce.model.cache_entry import building, cache_error, damage, partial_prefix, record_sizes, remove
from triforce.paths import cache_root

GGUF_ARCHITECTURES = ("llama", "mistral", "qwen2")  # GGUF names of the decoders triforce runs


def converted_dir_for(gguf_path: Path) -> Path:
    stat = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()
    return cache_root() / "converted" / f"{gguf_path.stem}-{key[:12]}"


def convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """The converted folder `out_dir`, built once (see triforce.model.cache_entry) and rebuilt
    when it is found damaged."""
    if out_dir.exists() and damage(out_dir) is None:
        return out_dir
    float_bytes = _check_header(gguf_path)
    try:
        with building(out_dir, f"the conversion of {gguf_path.name}"):
            if out_dir.exists():  # another process may have finished it while we waited
                problem = damage(out_dir)
                if problem is None:
                    return out_dir
                print(f"the cached model {out_dir} is damaged ({problem}); converting it again", file=sys.stderr)
                remove(out_dir)
            free = shutil.disk_usage(out_dir.parent).free
            if free < float_bytes:
                raise UserError(f"converting {gguf_path.name} needs about {float_bytes / 1e9:.1f} GB in the cache "
                                f"folder {cache_root()} but {free / 1e9:.1f} GB are free (set TRIFORCE_CACHE "
                                "to a folder with room)")
            print(f"converting {gguf_path.name} to safetensors (one time; cached in {out_dir})", file=sys.stderr)
            tmp = Path(tempfile.mkdtemp(prefix=partial_prefix(out_dir), dir=out_dir.parent))
            try:
                _convert_into(gguf_path, tmp)
                record_sizes(tmp)
                tmp.rename(out_dir)
            finally:
                remove(tmp)
    except OSError as e:
        raise cache_error(e, f"the conversion of {gguf_path.name}") from None
    return out_dir


def _convert_into(gguf_path: Path, folder: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    where, name = str(gguf_path.parent), gguf_path.name
    started = time.perf_counter()
    try:
        _say("  1/3 reading the tokenizer from the file")
        tokenizer = AutoTokenizer.from_pretrained(where, gguf_file=name)
        _say(f"  2/3 de-quantizing the weights to float32 (transformers; tens of seconds; "
             f"{time.perf_counter() - started:.0f} s so far)")
        model, info = AutoModelForCausalLM.from_pretrained(where, gguf_file=name, dtype=torch.float32,
                                                           output_loading_info=True)
    except Exception as e:
        raise _unreadable(gguf_path, e) from None
    _say(f"  3/3 writing safetensors ({time.perf_counter() - started:.0f} s so far)")
    missing = sorted(set(info.get("missing_keys", ())) - ({"lm_head.weight"} if model.config.tie_word_embeddings
                                                           else set()))
    if missing:
        raise UserError(f"GGUF file {gguf_path} lacks {len(missing)} tensor(s) the model needs, e.g. "
                        f"'{missing[0]}' (an incomplete or edited file); nothing was converted or cached")
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    model.config.quantization_config = None  # the weights are dequantised: say so, as before
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.save_pretrained(folder)
    model.generation_config.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    save_weights(state, folder / "model.safetensors")


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def save_weights(state: dict, path: Path) -> None:
    """safetensors' save_file, its errors as OSError: a full disk is SafetensorError there."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    try:
        save_file(state, str(path), metadata={"format": "pt"})
    except SafetensorError as e:
        full = "No space left" in str(e)
        raise OSError(errno.ENOSPC if full else errno.EIO, os.strerror(errno.ENOSPC) if full else str(e)) from None


def _unreadable(gguf_path: Path, error: Exception) -> UserError:
    msg = str(error).splitlines()[0] if str(error) else type(error).__name__
    return UserError(f"cannot read GGUF file {gguf_path} (corrupt, truncated or unsupported?): {msg}")


def _check_header(gguf_path: Path) -> int:
    """Parse the header and tensor table (memory-mapped, cheap) before any slow work: the
    architecture must be one triforce runs. Returns the bytes of the float32 conversion."""
    from gguf import GGUFReader
    try:
        reader = GGUFReader(str(gguf_path))
        field = reader.fields.get("general.architecture")
        arch = field.contents() if field is not None else None
        elements = sum(int(t.n_elements) for t in reader.tensors)
    except Exception as e:
        raise _unreadable(gguf_path, e) from None
    if arch not in GGUF_ARCHITECTURES:
        raise UserError(f"GGUF file {gguf_path} holds a '{arch}' model; triforce runs "
                        f"{', '.join(GGUF_ARCHITECTURES)} (nothing was converted)")
    missing = _missing_tensors(reader, arch)
    if missing:
        raise UserError(f"GGUF file {gguf_path} lacks {len(missing)} tensor(s) the model needs, e.g. "
                        f"'{missing[0]}' (an incomplete or edited file); nothing was converted or cached")
    return 4 * elements + (64 << 20)  # float32 weights plus the tokenizer and config


def _missing_tensors(reader, arch: str) -> list[str]:
    """The decoder weights a dense llama-like GGUF must hold (names from gguf's own tables),
    checked from the header so an incomplete file is refused in a second, not after the
    conversion; anything subtler (a bias) is still caught when the conversion loads it."""
    from gguf import MODEL_TENSOR, TENSOR_NAMES

    block_field = reader.fields.get(f"{arch}.block_count")
    blocks = int(block_field.contents()) if block_field is not None else 0
    per_block = (MODEL_TENSOR.ATTN_NORM, MODEL_TENSOR.ATTN_Q, MODEL_TENSOR.ATTN_K, MODEL_TENSOR.ATTN_V,
                 MODEL_TENSOR.ATTN_OUT, MODEL_TENSOR.FFN_NORM, MODEL_TENSOR.FFN_GATE, MODEL_TENSOR.FFN_UP,
                 MODEL_TENSOR.FFN_DOWN)
    needed = [TENSOR_NAMES[MODEL_TENSOR.TOKEN_EMBD], TENSOR_NAMES[MODEL_TENSOR.OUTPUT_NORM]]
    needed += [TENSOR_NAMES[t].format(bid=b) for b in range(blocks) for t in per_block]
    present = {t.name for t in reader.tensors}
    return [f"{name}.weight" for name in needed if f"{name}.weight" not in present]
