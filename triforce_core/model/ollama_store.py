"""`--model ollama:[HOST/][NAMESPACE/]NAME[:TAG]` from Ollama's store (OLLAMA_MODELS, else
~/.ollama/models): a manifest per name, parsed by Ollama's name rules, whose model layer names the
GGUF blob by a `sha256:<64 hex>` digest; manifests read with a bound."""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from triforce.errors import UserError
from triforce.paths import inside, read_small, shown

OLLAMA_PREFIX = "ollama:"
OLLAMA_MODEL_LAYER = "application/vnd.ollama.image.model"
OLLAMA_DIGEST = re.compile(r"sha256:(?P<hex>[0-9a-f]{64})")
OLLAMA_PART = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,79}")  # a namespace or a model (Ollama's rules)
OLLAMA_HOST = re.compile(r"[A-Za-z0-9][A-Za-z0-9.-]{0,252}")
OLLAMA_TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,79}")
MANIFEST_LIMIT = 1 << 20  # Ollama's manifests are a few KB


def ollama_root() -> Path:
    return Path(os.environ.get("OLLAMA_MODELS") or Path.home() / ".ollama" / "models").expanduser()


@dataclass(frozen=True)
class OllamaName:
    """[HOST/][NAMESPACE/]MODEL[:TAG], each part by Ollama's rules; the defaults as Ollama's."""
    host: str = "registry.ollama.ai"
    namespace: str = "library"
    model: str = ""
    tag: str = "latest"

    @classmethod
    def parse(cls, text: str) -> "OllamaName":
        if not text:
            raise UserError("--model ollama: needs a name, e.g. ollama:llama3.1:8b")
        path, colon, tag = text.rpartition(":") if ":" in text.rsplit("/", 1)[-1] else (text, "", "")
        parts = path.split("/")
        rules = [OLLAMA_PART] if len(parts) == 1 else [OLLAMA_PART] * 2 if len(parts) == 2 else \
            [OLLAMA_HOST, OLLAMA_PART, OLLAMA_PART] if len(parts) == 3 else None
        if rules is None or not all(rule.fullmatch(part) for rule, part in zip(rules, parts)) or (
                colon and not OLLAMA_TAG.fullmatch(tag)):
            raise UserError(f"'ollama:{shown(text)}' is not an Ollama model name ([HOST/][NAMESPACE/]NAME[:TAG]; "
                            "letters, digits, '_', '-' and '.', each part starting with a letter or digit)")
        fields = dict(zip(("host", "namespace", "model")[-len(parts):], parts))
        return cls(**fields, **({"tag": tag} if colon else {}))

    def __str__(self) -> str:
        where = "" if self.host == OllamaName.host else f"{self.host}/"
        where += "" if not where and self.namespace == OllamaName.namespace else f"{self.namespace}/"
        return f"{where}{self.model}:{self.tag}"

    def manifest(self, root: Path) -> Path:
        return root / "manifests" / self.host / self.namespace / self.model / self.tag


def ollama_blob(text: str) -> Path:
    """[HOST/][NAMESPACE/]NAME[:TAG] -> the GGUF blob its manifest's model layer names."""
    name = OllamaName.parse(text)
    root = ollama_root()
    manifest = name.manifest(root)
    if not inside(manifest, root / "manifests"):  # the grammar allows none; a second look costs nothing
        raise UserError(f"'ollama:{shown(text)}' leads outside Ollama's store")
    if not _is_file(manifest):
        raise UserError(f"ollama model '{name}' is not in Ollama's store (looked for {manifest}; "
                        f"with network run `ollama pull {name}`, or set OLLAMA_MODELS)")
    text = read_small(manifest, "Ollama's manifest", MANIFEST_LIMIT)
    try:
        layers = json.loads(text)["layers"]
        digest = next(layer["digest"] for layer in layers if layer.get("mediaType") == OLLAMA_MODEL_LAYER)
    except (ValueError, KeyError, TypeError, AttributeError, StopIteration) as e:
        raise UserError(f"cannot read Ollama's manifest {manifest}: {e or 'it names no model layer'}") from None
    match = OLLAMA_DIGEST.fullmatch(digest) if isinstance(digest, str) else None
    if match is None:
        raise UserError(f"Ollama's manifest {manifest} names the layer '{shown(str(digest))}', not a digest "
                        "sha256:<64 hex digits>: a damaged or forged manifest")
    blob = root / "blobs" / f"sha256-{match['hex']}"
    if not _is_file(blob):
        raise UserError(f"Ollama's manifest {manifest} names {blob}, which is missing (run `ollama pull "
                        f"{name}` again)")
    return blob


def _is_file(path: Path) -> bool:
    try:
        return path.is_file()
    except OSError:  # a name too long, a part that is a file: not there
        return False
