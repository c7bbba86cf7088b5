"""`--model` by name, offline: `ORG/NAME[@REVISION]` from the Hugging Face cache (the hub's own
lookup, never downloading; HF_HOME / HF_HUB_CACHE move it) and `ollama:NAME[:TAG]` from Ollama's
store (OLLAMA_MODELS, else ~/.ollama/models: a manifest per NAME:TAG whose model layer names the
GGUF blob). A name that is not there is one error line saying where it looked and how to get it."""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

from triforce.errors import UserError

HF_NAME = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<revision>[\w./-]+))?")
OLLAMA_PREFIX = "ollama:"
OLLAMA_MODEL_LAYER = "application/vnd.ollama.image.model"
GGUF_MAGIC = b"GGUF"


def locate(spec: str) -> Path | None:
    """The file or folder a model name stands for (None: `spec` is no name, e.g. a path)."""
    if spec.startswith(OLLAMA_PREFIX):
        return ollama_blob(spec[len(OLLAMA_PREFIX):])
    match = HF_NAME.fullmatch(spec)
    if match is None or Path(spec).expanduser().exists():
        return None
    return hf_snapshot(match["repo"], match["revision"])


def hf_snapshot(repo: str, revision: str | None = None) -> Path:
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo, revision=revision, local_files_only=True))
    except (LocalEntryNotFoundError, FileNotFoundError, ValueError):
        at = f"@{revision}" if revision else ""
        raise UserError(f"model '{repo}{at}' is neither a path here nor in the Hugging Face cache (looked in "
                        f"{constants.HF_HUB_CACHE}; "
                        f"triforce never downloads: with network run `hf download {repo}"
                        f"{' --revision ' + revision if revision else ''}`, or give a folder or .gguf path)") from None


def ollama_root() -> Path:
    return Path(os.environ.get("OLLAMA_MODELS") or Path.home() / ".ollama" / "models").expanduser()


def ollama_blob(name: str) -> Path:
    """NAME[:TAG] (TAG latest) -> its GGUF blob; NAME may carry a namespace (user/name)."""
    model, _, tag = name.partition(":")
    if not model:
        raise UserError("--model ollama: needs a name, e.g. ollama:llama3.1:8b")
    manifest = ollama_root() / "manifests" / "registry.ollama.ai" / (model if "/" in model else f"library/{model}")
    manifest = manifest / (tag or "latest")
    try:
        layers = json.loads(manifest.read_text())["layers"]
        digest = next(layer["digest"] for layer in layers if layer.get("mediaType") == OLLAMA_MODEL_LAYER)
    except FileNotFoundError:
        raise UserError(f"ollama model '{model}:{tag or 'latest'}' is not in Ollama's store (looked for {manifest}; "
                        f"with network run `ollama pull {model}:{tag or 'latest'}`, or set OLLAMA_MODELS)") from None
    except (OSError, ValueError, KeyError, TypeError, StopIteration) as e:
        raise UserError(f"cannot read Ollama's manifest {manifest}: {e or 'it names no model layer'}") from None
    blob = ollama_root() / "blobs" / digest.replace(":", "-")
    if not blob.is_file():
        raise UserError(f"Ollama's manifest {manifest} names {blob}, which is missing (run `ollama pull "
                        f"{model}:{tag or 'latest'}` again)")
    return blob


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


def _folder_verdict(folder: Path) -> tuple[bool, str, str]:
    from triforce.model.gguf_convert import GGUF_ARCHITECTURES

    if (folder / "config.json").is_file():
        kind = "safetensors" if list(folder.glob("*.safetensors")) else "bin"
        try:
            model_type = json.loads((folder / "config.json").read_text()).get("model_type")
        except (OSError, ValueError):
            return False, "config.json unreadable", kind
        from triforce.config.model import SUPPORTED_MODEL_TYPES

        runs = model_type in SUPPORTED_MODEL_TYPES
        return runs, model_type if runs else f"model_type {model_type} (runs {', '.join(SUPPORTED_MODEL_TYPES)})", kind
    ggufs = sorted(folder.glob("*.gguf"))
    if len(ggufs) == 1:
        arch = gguf_architecture(ggufs[0])
        return arch in GGUF_ARCHITECTURES, arch or "unreadable header", "gguf"
    return False, f"{len(ggufs)} .gguf files: give one as a path" if ggufs else "no config.json or .gguf", "?"


def _ollama_models() -> list[dict]:
    from triforce.model.gguf_convert import GGUF_ARCHITECTURES

    root = ollama_root() / "manifests" / "registry.ollama.ai"
    found = []
    for manifest in sorted(p for p in root.rglob("*") if p.is_file()) if root.is_dir() else []:
        namespace, model, tag = manifest.relative_to(root).parts[-3:]
        name = f"ollama:{model if namespace == 'library' else namespace + '/' + model}:{tag}"
        try:
            blob = ollama_blob(name[len(OLLAMA_PREFIX):])
        except UserError as e:
            found.append({"model": name, "format": "gguf", "bytes": None, "runs": False, "note": str(e), "path": None})
            continue
        arch = gguf_architecture(blob)
        found.append({"model": name, "format": "gguf", "bytes": blob.stat().st_size, "path": str(blob),
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
            for _ in range(min(count, 64)):
                key = f.read(struct.unpack("<Q", f.read(8))[0]).decode()
                kind = struct.unpack("<I", f.read(4))[0]
                if kind == 8:
                    value = f.read(struct.unpack("<Q", f.read(8))[0]).decode()
                    if key == "general.architecture":
                        return value
                elif kind == 9:
                    return None  # an array before the architecture: not a layout llama.cpp writes
                else:
                    f.read(sizes[kind])
    except (OSError, struct.error, KeyError, UnicodeDecodeError):
        return None
    return None
