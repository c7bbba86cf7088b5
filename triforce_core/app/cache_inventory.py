"""What the cache folder holds, entry by entry, and which entries nothing will use again
(`triforce cache`, `triforce cache prune`).

Stale: a model folder whose GGUF file is gone or changed, an older triforce's float32 copy of a
GGUF (the weights are now read from the file), kernels compiled for other triforce sources, a
tensor index no known file matches, and builds a killed process left over a day ago.

Prune removes only what triforce made and marked as its own: the files a model folder's record
(triforce-manifest.json) lists, numba's own kernel files, tensor indexes that read as ours,
builds named `.partial-*`. Anything else (a user's notes, a link, a folder of the cache that is
itself a link) is listed as not triforce's and left; no link is ever followed; an entry whose
lock another process holds (the lock its writer takes) is left for a later prune."""
from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

from triforce.paths import cache_root, remove_files

NUMBA_FOLDER = re.compile(r"[0-9a-f]{16}")  # triforce.numba_cache names its folders by a digest
FOREIGN = "not triforce's (left as it is)"


@dataclass(frozen=True)
class Entry:
    path: Path
    bytes: int
    what: str
    stale: str | None = None  # why nothing will use it again
    own: tuple[Path, ...] = ()      # what prune removes of it: the files triforce made (the path itself where empty)
    foreign: tuple[Path, ...] = ()  # files inside it triforce did not make: left
    lock: Path | None = None        # the lock its writer holds while it builds it


@dataclass(frozen=True)
class Outcome:
    entry: Entry
    removed: bool  # False: another process holds it (left for a later prune)
    bytes: int     # freed, or that would be


def inventory(root: Path | None = None) -> list[Entry]:
    """Every entry under the cache folder, the default model's first."""
    root = root or cache_root()
    if not root.is_dir():
        return []
    entries: list[Entry] = []
    sources: set[Path] = set()
    for folder in ("models", "converted"):
        for child in _children(root / folder, entries):
            entry, source = _model_entry(child)
            entries.append(entry)
            sources |= {source} if source is not None else set()
    from triforce.model.cache_entry import MANIFEST

    files = [p for p in _children(root / "gguf", entries) if p.name != MANIFEST]  # the manifest is the folder's
    sources |= set(files)
    entries += [Entry(p, _size(p), "the default model's GGUF file") for p in files]
    entries += [Entry(p, _size(p), "the wheel the default model came from (unpacked again if its file is damaged)")
                for p in _children(root / "wheels", entries)]
    entries += [_numba_entry(p) for p in _children(root / "numba", entries)]
    entries += [_index_entry(p, sources) for p in _children(root / "gguf-index", entries)]
    entries += _partial_entries(root)
    known = {"models", "converted", "gguf", "wheels", "numba", "gguf-index"}
    entries += [Entry(p, _size(p), FOREIGN) for p in _children(root, entries) if p.name not in known]
    return entries


def prune(entries: list[Entry], dry_run: bool = False) -> list[Outcome]:
    """Remove what triforce made of each stale entry (dry_run: say what would go, remove nothing);
    an entry another process holds is left. The same steps decide both, so a dry run lists
    exactly what a prune removes."""
    from filelock import FileLock, Timeout

    from triforce.model.cache_entry import held

    outcomes = []
    for entry in (e for e in entries if e.stale is not None):
        if dry_run:  # a look only: no lock file made where none is
            busy = entry.lock is not None and entry.lock.exists() and held(entry.lock)
            outcomes.append(Outcome(entry, not busy, 0 if busy else _own_bytes(entry)))
            continue
        lock = FileLock(str(entry.lock)) if entry.lock is not None else None
        try:
            if lock is not None:
                lock.acquire(timeout=0)  # held while removing: a writer waits for it
        except (Timeout, OSError):
            outcomes.append(Outcome(entry, False, 0))
            continue
        try:
            freed = _own_bytes(entry)
            _remove_own(entry)
            outcomes.append(Outcome(entry, True, freed))
        finally:
            if lock is not None:
                lock.release()
    return outcomes


def _own_bytes(entry: Entry) -> int:
    return sum(_size(p) for p in entry.own or (entry.path,))


def _remove_own(entry: Entry) -> None:
    """The entry's own files, and the folders that leaves empty; never a link's target."""
    from triforce.model.cache_entry import remove

    if entry.own:
        remove_files(entry.path, entry.own)  # what triforce did not make stays, in its folders
    else:
        remove(entry.path)  # a file, or a `.partial-*` build: all of it triforce's


def _model_entry(folder: Path) -> tuple[Entry, Path | None]:
    from triforce.errors import UserError
    from triforce.model.cache_entry import MANIFEST, damage, recorded_files
    from triforce.model.gguf_convert import conversion_digest
    from triforce.model.gguf_weights import GgufSource

    size = _size(folder)
    if folder.is_symlink() or not folder.is_dir():
        return Entry(folder, size, FOREIGN), None
    listed = recorded_files(folder)
    if listed is None:
        return Entry(folder, size, f"a folder without triforce's record of its files: {FOREIGN}"), None
    own = tuple(folder / name for name in listed if _plain_file(folder / name)) + (folder / MANIFEST,)
    foreign = tuple(p for p in _walk(folder) if p not in own)
    lock = folder.parent / f".{folder.name}.lock"
    try:
        source = GgufSource.read(folder)
    except UserError as e:
        return Entry(folder, size, "a model folder", f"damaged ({e})", own, foreign, lock), None
    if source is None:
        return Entry(folder, size, "a converted GGUF", "an older triforce's float32 copy (weights are now "
                                                        "read from the file)", own, foreign, lock), None
    what = f"tokenizer and config of {source.path} (the weights stay in the file)"
    problem = damage(folder) or source.changed() or (
        None if source.made_by == conversion_digest() else "made by another version of triforce's GGUF reading")
    return Entry(folder, size, what, problem, own, foreign, lock), source.path


def _numba_entry(folder: Path) -> Entry:
    """numba writes *.nbi (index) and *.nbc (code) files into the folder use_versioned_cache names."""
    from triforce.numba_cache import numba_files, source_digest

    if folder.is_symlink() or not folder.is_dir() or not NUMBA_FOLDER.fullmatch(folder.name):
        return Entry(folder, _size(folder), FOREIGN)
    own = numba_files(folder)
    foreign = tuple(p for p in _walk(folder) if p not in own)
    if folder.name == source_digest():
        return Entry(folder, _size(folder), "compiled CPU kernels of these sources", None, own, foreign)
    return Entry(folder, _size(folder), "compiled CPU kernels", "compiled for other triforce sources", own, foreign)


def _index_entry(path: Path, sources: set[Path]) -> Entry:
    """An index is named stem-size-mtime (triforce.model.gguf_index) and reads as one: stale
    unless a known file matches."""
    from triforce.model.gguf_index import is_index

    if not _plain_file(path) or path.suffix != ".json" or not is_index(path):
        return Entry(path, _size(path), FOREIGN)
    names = set()
    for source in sources:
        try:
            stat = source.stat()
        except OSError:
            continue
        names.add(f"{source.stem}-{stat.st_size}-{stat.st_mtime_ns}.json")
    return Entry(path, _size(path), "tensor positions of a GGUF file", None if path.name in names
                 else "no GGUF file triforce knows matches it")


def _partial_entries(root: Path) -> list[Entry]:
    from triforce.model.cache_entry import STALE_S, lock_of_partial

    found = []
    folders = [root] + [p for p in (root / name for name in ("models", "converted", "gguf", "wheels"))
                        if p.is_dir() and not p.is_symlink()]
    for folder in folders:
        for p in sorted(folder.glob(".partial-*")):
            old = time.time() - p.lstat().st_mtime > STALE_S
            found.append(Entry(p, _size(p), "a build in progress, or left by a killed one",
                               "left by a build killed over a day ago" if old and not p.is_symlink() else None,
                               lock=lock_of_partial(p)))
    return found


def _children(folder: Path, entries: list[Entry]) -> list[Path]:
    """The entries in one of the cache's folders; a folder that is a link is listed as such
    (in `entries`) and not looked into."""
    if folder.is_symlink():
        entries.append(Entry(folder, 0, f"a link to {os.readlink(folder)}, outside the cache: {FOREIGN}"))
        return []
    return sorted(p for p in folder.iterdir() if not p.name.startswith(".")) if folder.is_dir() else []


def _plain_file(path: Path) -> bool:
    return not path.is_symlink() and path.is_file()


def _walk(folder: Path) -> list[Path]:
    """Every file and link below `folder`, no link followed."""
    found = []
    for where, dirs, files in os.walk(folder):
        found += [Path(where) / name for name in files]
        found += [Path(where) / name for name in dirs if (Path(where) / name).is_symlink()]
    return found


def _size(path: Path) -> int:
    try:
        if path.is_symlink() or not path.is_dir():
            return path.lstat().st_size
        return sum(p.lstat().st_size for p in _walk(path))
    except OSError:
        return 0


def as_json(entry: Entry) -> dict:
    return {"path": str(entry.path), "bytes": entry.bytes, "what": entry.what, "stale": entry.stale,
            "foreign": [str(p) for p in entry.foreign]}

