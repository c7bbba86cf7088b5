"""`--model` by name, offline: `ORG/NAME[@REVISION]` from the Hugging Face cache
(triforce.model.hub_cache) and `ollama:[HOST/][NAMESPACE/]NAME[:TAG]` from Ollama's store
(triforce.model.ollama_store). A name that is not there is one error line saying where it looked
and how to get it.

A name is parsed by its grammar (the Hub's repo ids and git's ref names; Ollama's name parts and
`sha256:<64 hex>` digests) and never joined into a path as typed: `..`, absolute parts and what a
store's own files say are refused, and every path a name resolves to is checked to lie inside its
store, following only the links the store's layout makes (a snapshot's files link to its blobs)."""
from __future__ import annotations

import json
import re
from pathlib import Path

from triforce.errors import UserError
from triforce.model.hub_cache import hf_snapshot
from triforce.model.ollama_store import OLLAMA_PREFIX, OllamaName, ollama_blob, ollama_root
from triforce.paths import read_small

HF_NAME = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<revision>.*))?", re.S)  # checked by hub_cache
GGUF_MAGIC = b"GGUF"


def locate(spec: str) -> Path | None:
    """The file or folder a model name stands for (None: `spec` is no name, e.g. a path)."""
    if spec.startswith(OLLAMA_PREFIX):
        return ollama_blob(spec[len(OLLAMA_PREFIX):])
    match = HF_NAME.fullmatch(spec)
    if match is None or _exists(Path(spec).expanduser()):
        return None
    return hf_snapshot(match["repo"], match["revision"])


def _exists(path: Path) -> bool:
    try:
        return path.exists()
    except OSError:  # a name too long for a path is no path here
        return False


def is_gguf(path: Path) -> bool:
    """A file that starts as a GGUF does (Ollama's blobs have no .gguf suffix)."""
    if path.suffix == ".gguf":
        return path.is_file()
    try:
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


def available() -> list[dict]:
    """What `--model` could name here: the default model, the Hugging Face cache's snapshots and
    Ollama's models, each with its format, size and whether triforce runs it (and why not)."""
    from triforce.model.default_model import GGUF_NAME
    from triforce.paths import cache_root

    default = cache_root() / "gguf" / GGUF_NAME
    found = [{"model": "default", "format": "gguf", "bytes": default.stat().st_size if default.exists() else None,
              "runs": True, "note": "SmolLM2-135M-Instruct" + ("" if default.exists() else ", fetched on first use"),
              "path": str(default)}]
    return found + _hf_models() + _ollama_models()


def _folder_verdict(folder: Path) -> tuple[bool, str, str]:
    from triforce.model.gguf_convert import GGUF_ARCHITECTURES

    if (folder / "config.json").is_file():
        kind = "safetensors" if list(folder.glob("*.safetensors")) else "bin"
        try:
            model_type = json.loads(read_small(folder / "config.json", "the config")).get("model_type")
        except (UserError, ValueError, AttributeError):
            return False, "config.json unreadable", kind
        from triforce.config.model import SUPPORTED_MODEL_TYPES

        runs = model_type in SUPPORTED_MODEL_TYPES
        return runs, model_type if runs else f"model_type {model_type} (runs {', '.join(SUPPORTED_MODEL_TYPES)})", kind
    ggufs = sorted(folder.glob("*.gguf"))
    if len(ggufs) == 1:
        arch = gguf_architecture(ggufs[0])
        return arch in GGUF_ARCHITECTURES, arch or "unreadable header", "gguf"
    return False, f"{len(ggufs)} .gguf files: give one as a path" if ggufs else "no config.json or .gguf", "?"


def _hf_models() -> list[dict]:
    from huggingface_hub import scan_cache_dir

    try:
        repos = scan_cache_dir().repos
    except Exception:  # no cache folder (CacheNotFound), or one the hub cannot read: nothing to list
        return []
    found = []
    for repo in sorted((r for r in repos if r.repo_type == "model"), key=lambda r: r.repo_id):
        for revision in sorted(repo.revisions, key=lambda r: "main" not in r.refs):
            name = repo.repo_id if "main" in revision.refs else f"{repo.repo_id}@{revision.commit_hash}"
            runs, note, kind = _folder_verdict(Path(revision.snapshot_path))
            found.append({"model": name, "format": kind, "bytes": revision.size_on_disk, "runs": runs, "note": note,
                          "path": str(revision.snapshot_path)})
    return found


def _ollama_models() -> list[dict]:
    """Every manifest of the store, by host (Ollama keeps hf.co's models beside its own registry's)."""
    from triforce.model.gguf_convert import GGUF_ARCHITECTURES

    root = ollama_root() / "manifests"
    found = []
    for manifest in sorted(p for p in root.glob("*/*/*/*") if p.is_file()) if root.is_dir() else []:
        host, namespace, model, tag = manifest.relative_to(root).parts
        try:
            name = str(OllamaName(host, namespace, model, tag))
            blob = ollama_blob(name)
        except UserError as e:
            found.append({"model": f"ollama:{name}", "format": "gguf", "bytes": None, "runs": False, "note": str(e),
                          "path": None})
            continue
        arch = gguf_architecture(blob)
        found.append({"model": f"ollama:{name}", "format": "gguf", "bytes": blob.stat().st_size, "path": str(blob),
                      "runs": arch in GGUF_ARCHITECTURES, "note": arch or "unreadable header"})
    return found


def gguf_architecture(path: Path) -> str | None:
    """general.architecture from a GGUF header, read key by key (it comes first in files
    llama.cpp writes) without parsing the tokenizer's arrays that follow; None: unreadable."""
    import struct

    sizes = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
    try:
        with open(path, "rb") as f:
            if f.read(4) != GGUF_MAGIC:
                return None
            _, _, count = struct.unpack("<IQQ", f.read(20))

            def string() -> str:
                size = struct.unpack("<Q", f.read(8))[0]
                if size > 1 << 16:  # no key or architecture is this long: a damaged header
                    raise ValueError(size)
                return f.read(size).decode()

            for _ in range(min(count, 64)):
                key = string()
                kind = struct.unpack("<I", f.read(4))[0]
                if kind == 8:
                    value = string()
                    if key == "general.architecture":
                        return value
                elif kind == 9:
                    return None  # an array before the architecture: not a layout llama.cpp writes
                else:
                    f.read(sizes[kind])
    except (OSError, struct.error, KeyError, ValueError):
        return None
    return None
