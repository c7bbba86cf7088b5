"""Where numba keeps triforce's compiled kernels: one folder per version of their sources.

Why: numba checks a cached function against its own file's time stamp and size only, so a kernel
whose callee lives in another file that changed (an upgrade, an edit) loads the old machine code.
It happened here: after bf16_scores.py changed, cpu_attention's cached attention still ran the old
scores, a third slower. Here
the folder is named by a digest of every file that holds numba code, so any change compiles
afresh; the newest few folders are kept, older ones removed. `NUMBA_CACHE_DIR`, when set, wins."""
from __future__ import annotations

import hashlib
import os
import re
import sys
from importlib.util import find_spec
from pathlib import Path

from triforce.paths import cache_root, remove_files

_PACKAGES = ("triforce.kernels", "triforce.pinned", "triforce.bench")  # the ones with numba code
_KEEP = 3  # folders kept: the current sources and two before them (a switch back is free)
_DIGEST = re.compile(r"[0-9a-f]{16}")  # the folders' names (source_digest)
_NUMBA_SUFFIXES = (".nbi", ".nbc")     # numba's cache index and compiled code


def source_folders() -> list[Path]:
    """The folders of the packages that hold numba code (found without importing them)."""
    return [Path(folder) for package in _PACKAGES for folder in find_spec(package).submodule_search_locations]


def source_digest(folders: list[Path] | None = None) -> str:
    """A digest of the Python files (names and bytes) in `folders` (default: source_folders())."""
    digest = hashlib.sha256()
    for folder in folders or source_folders():
        for path in sorted(folder.rglob("*.py")):  # kernels/cpu/ and kernels/cuda/ included
            digest.update(f"{folder.name}/{path.relative_to(folder).as_posix()}\0".encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def use_versioned_cache(root: Path | None = None) -> Path | None:
    """Point numba's cache at `root/<digest>` (root: triforce's cache folder's `numba`), unless
    NUMBA_CACHE_DIR is set; returns the folder, or None where the user's setting stands or
    the folder cannot be made (numba then keeps its own default)."""
    if os.environ.get("NUMBA_CACHE_DIR"):
        return None
    root = root or cache_root() / "numba"
    folder = root / source_digest()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        os.utime(folder)
    except OSError:
        return None
    _prune(root, folder)
    os.environ["NUMBA_CACHE_DIR"] = str(folder)  # read when numba is imported, and by child processes
    if "numba" in sys.modules:  # imported already: its config was read then
        sys.modules["numba"].config.CACHE_DIR = str(folder)
    return folder


def numba_files(folder: Path) -> tuple[Path, ...]:
    """The files numba wrote in one of these folders (its index and code files, in a subfolder per
    source folder), no link among them: the only ones triforce ever removes there."""
    return tuple(sorted(Path(where) / name for where, _, files in os.walk(folder) for name in files
                        if Path(name).suffix in _NUMBA_SUFFIXES and not os.path.islink(os.path.join(where, name))))


def _prune(root: Path, current: Path) -> None:
    """Remove all but the _KEEP most recently used folders (the current one always stays): numba's
    files in them, then each folder if nothing else is left (a folder that is a link, or not named
    as use_versioned_cache names them, is not triforce's and stays)."""
    others = sorted((p for p in root.iterdir() if p != current and _DIGEST.fullmatch(p.name) and not p.is_symlink()
                     and p.is_dir()), key=lambda p: p.stat().st_mtime)
    for old in others[:max(0, len(others) - (_KEEP - 1))]:
        try:
            remove_files(old, numba_files(old))
        except OSError:
            pass  # a file another process holds: the next start tries again
