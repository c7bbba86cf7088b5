"""Turn a GGUF file into a cached Hugging Face folder (config, tokenizer, float32 safetensors).

Dequantising through transformers takes tens of seconds; doing it once and keeping the result
makes every later start fast."""
from __future__ import annotations

import hashlib
import shutil
import sys
import tempfile
from pathlib import Path

from triforce.errors import UserError
from triforce.paths import cache_root


def converted_dir_for(gguf_path: Path) -> Path:
    stat = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()
    return cache_root() / "converted" / f"{gguf_path.stem}-{key[:12]}"


def convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """Write the converted folder to `out_dir` atomically (a temp folder renamed at the end)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if (out_dir / "config.json").exists():
        return out_dir
    _check_readable(gguf_path)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    print(f"converting {gguf_path.name} to safetensors (one time; cached in {out_dir})", file=sys.stderr)
    folder, name = str(gguf_path.parent), gguf_path.name
    tmp = Path(tempfile.mkdtemp(prefix=".partial-", dir=out_dir.parent))
    try:
        try:
            tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
            model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
        except Exception as e:
            raise _unreadable(gguf_path, e) from None
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        if model.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        model.config.quantization_config = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.config.save_pretrained(tmp)
        model.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        del model, state
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def _unreadable(gguf_path: Path, error: Exception) -> UserError:
    msg = str(error).splitlines()[0] if str(error) else type(error).__name__
    return UserError(f"cannot read GGUF file {gguf_path} (corrupt, truncated or unsupported?): {msg}")


def _check_readable(gguf_path: Path) -> None:
    """Parse the header and tensor table (memory-mapped, cheap) before any slow work."""
    from gguf import GGUFReader
    try:
        GGUFReader(str(gguf_path))
    except Exception as e:
        raise _unreadable(gguf_path, e) from None
