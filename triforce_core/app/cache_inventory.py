"""What the cache folder holds, entry by entry, and which entries nothing will use again
(`triforce cache`, `triforce cache prune`).

Stale: a model folder whose GGUF file is gone or changed, an older triforce's float32 copy of a
GGUF (the weights are now read from the file), kernels compiled for other triforce sources, a
tensor index no known file matches, and builds a killed process left over a day ago. In use or
unknown: listed, never removed."""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from triforce.paths import cache_root


@dataclass(frozen=True)
class Entry:
    path: Path
    bytes: int
    what: str
    stale: str | None = None  # why nothing will use it again


def inventory(root: Path | None = None) -> list[Entry]:
    """Every entry under the cache folder, the default model's first."""
    root = root or cache_root()
    if not root.is_dir():
        return []
    entries: list[Entry] = []
    sources: set[Path] = set()
    for folder in _children(root / "models") + _children(root / "converted"):
        entry, source = _model_entry(folder)
        entries.append(entry)
        sources |= {source} if source is not None else set()
    from triforce.model.cache_entry import MANIFEST

    files = [p for p in _children(root / "gguf") if p.name != MANIFEST]  # the manifest is the folder's
    sources |= set(files)
    entries += [Entry(p, _size(p), "the default model's GGUF file") for p in files]
    entries += [Entry(p, _size(p), "the wheel the default model came from (unpacked again if its file is damaged)")
                for p in _children(root / "wheels")]
    entries += _numba_entries(root / "numba")
    entries += _index_entries(root / "gguf-index", sources)
    entries += _partial_entries(root)
    known = {"models", "converted", "gguf", "wheels", "numba", "gguf-index"}
    entries += [Entry(p, _size(p), "not triforce's (left as it is)") for p in _children(root)
                if p.name not in known]
    return entries


def prune(entries: list[Entry]) -> list[Entry]:
    """Remove the stale entries; returns them."""
    from triforce.model.cache_entry import remove

    gone = [e for e in entries if e.stale is not None]
    for entry in gone:
        remove(entry.path)
    return gone


def _model_entry(folder: Path) -> tuple[Entry, Path | None]:
    from triforce.errors import UserError
    from triforce.model.cache_entry import damage
    from triforce.model.gguf_weights import GgufSource

    size = _size(folder)
    try:
        source = GgufSource.read(folder)
    except UserError as e:
        return Entry(folder, size, "a model folder", f"damaged ({e})"), None
    if source is None:
        return Entry(folder, size, "a converted GGUF", "an older triforce's float32 copy (weights are now "
                                                        "read from the file)"), None
    what = f"tokenizer and config of {source.path} (the weights stay in the file)"
    problem = damage(folder) or source.changed()
    return Entry(folder, size, what, problem), source.path


def _numba_entries(root: Path) -> list[Entry]:
    from triforce.numba_cache import source_digest

    current = source_digest()
    return [Entry(p, _size(p), "compiled CPU kernels of these sources" if p.name == current else
                  "compiled CPU kernels", None if p.name == current else "compiled for other triforce sources")
            for p in _children(root)]


def _index_entries(root: Path, sources: set[Path]) -> list[Entry]:
    """An index is named stem-size-mtime (triforce.model.gguf_index): stale unless a known file matches."""
    names = set()
    for path in sources:
        try:
            stat = path.stat()
        except OSError:
            continue
        names.add(f"{path.stem}-{stat.st_size}-{stat.st_mtime_ns}.json")
    return [Entry(p, _size(p), "tensor positions of a GGUF file", None if p.name in names
                  else "no GGUF file triforce knows matches it") for p in _children(root)]


def _partial_entries(root: Path) -> list[Entry]:
    from triforce.model.cache_entry import STALE_S

    found = []
    for folder in [root, *(p for p in _children(root) if p.is_dir())]:
        for p in folder.glob(".partial-*"):
            old = time.time() - p.lstat().st_mtime > STALE_S
            found.append(Entry(p, _size(p), "a build in progress, or left by a killed one",
                               "left by a build killed over a day ago" if old else None))
    return found


def _children(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if not p.name.startswith(".")) if folder.is_dir() else []


def _size(path: Path) -> int:
    if path.is_symlink() or not path.is_dir():
        return path.lstat().st_size
    return sum(p.lstat().st_size for p in path.rglob("*") if not p.is_dir() or p.is_symlink())
