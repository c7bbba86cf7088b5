"""Entries of the cache folder (a fetched wheel, an extracted GGUF, a converted model) that
concurrent first runs share safely and that repair themselves.

Each entry is built under its own lock into a uniquely named temporary path next to it, checked,
and renamed into place; what an earlier, killed build left behind is removed under that lock. A
finished entry records its files' sizes, so a damaged or half-copied one is noticed and rebuilt
instead of failing later with advice to delete the wrong thing."""
from __future__ import annotations

import errno
import json
import shutil
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from filelock import FileLock, Timeout

from triforce.errors import UserError
from triforce.paths import cache_root, read_small

MANIFEST = "triforce-manifest.json"
STALE_S = 86400    # no build takes a day: a partial build this old was killed
LOCK_WAIT_S = 1800  # a conversion by another process takes a minute; a wait this long means it hangs


def cache_error(error: OSError, thing: str) -> UserError:
    """A read-only, full or non-directory cache folder as one line that says what to do."""
    reason = error.strerror or str(error)
    fix = "free some space, or set TRIFORCE_CACHE to a folder with room" if error.errno == errno.ENOSPC \
        else "set TRIFORCE_CACHE to a writable folder"
    return UserError(f"cannot write {thing} to the cache folder {cache_root()}: {reason} ({fix})")


@contextmanager
def building(entry: Path, thing: str):
    """Hold the lock of `entry` (`thing` names it for people) and remove the partial builds a killed process left. Another
    process building the same entry is waited for (and said so)."""
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        lock = FileLock(str(entry.parent / f".{entry.name}.lock"))
        try:
            lock.acquire(timeout=0)
        except Timeout:
            print(f"waiting for another triforce process to finish writing {thing} ...", file=sys.stderr)
            lock.acquire(timeout=LOCK_WAIT_S)
    except Timeout:
        raise UserError(f"gave up waiting {LOCK_WAIT_S} s for another process writing {thing}; if none runs, "
                        f"delete {entry.parent / f'.{entry.name}.lock'}") from None
    except OSError as e:
        raise cache_error(e, thing) from None
    try:
        for stale in entry.parent.glob(".partial-*"):
            # ours (the lock says no one else builds this entry), or anyone's from a day ago not being built
            if stale.name.startswith(partial_prefix(entry)) or (
                    time.time() - stale.lstat().st_mtime > STALE_S and not held(lock_of_partial(stale))):
                remove(stale)
        yield
    finally:
        lock.release()


def partial_prefix(entry: Path) -> str:
    """Temporary builds of `entry` start with this; only the lock holder writes them."""
    return f".partial-{entry.name}-"


def remove(path: Path) -> None:
    """A file, a link (never what it leads to) or a folder triforce built, all of it."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def record_sizes(folder: Path) -> None:
    """Written last, inside the temporary folder: an entry without it is unfinished."""
    sizes = {p.name: p.stat().st_size for p in sorted(folder.iterdir())
             if p.is_file() and p.name != MANIFEST and not p.name.startswith(".")}
    (folder / MANIFEST).write_text(json.dumps(sizes, indent=1))


def _record(folder: Path):
    """The entry's record as written (None: none, or not readable as JSON)."""
    try:
        return json.loads(read_small(folder / MANIFEST, "the record of a cache entry"))
    except (UserError, ValueError):
        return None


def recorded_files(folder: Path) -> list[str] | None:
    """The file names the entry's record lists (None: no record triforce wrote). Only plain names
    count: a record that names a path (a forged one) gives nothing outside its folder away."""
    sizes = _record(folder)
    if not isinstance(sizes, dict) or not all(isinstance(v, int) for v in sizes.values()):
        return None
    return [name for name in sizes if name == Path(name).name and name not in (".", "..")]


def lock_of_partial(partial: Path) -> Path | None:
    """The lock held while `partial` (a `.partial-<entry>-XXXX` build) is written, where one is there."""
    for lock in partial.parent.glob(".*.lock"):
        if partial.name.startswith(partial_prefix(partial.parent / lock.name[1:-len(".lock")])):
            return lock
    return None


def held(lock: Path | None) -> bool:
    """Another process holds `lock` now (building the entry it guards)."""
    if lock is None:
        return False
    probe = FileLock(str(lock))
    try:
        probe.acquire(timeout=0)
    except (Timeout, OSError):
        return True
    probe.release()
    return False


def damage(folder: Path) -> str | None:
    """None for a finished, intact entry, else what is wrong with it."""
    sizes = _record(folder)
    if sizes is None:
        return "unfinished (no record of its files)"
    if not isinstance(sizes, dict):
        return "its record of files is damaged"
    for name, size in sizes.items():
        path = folder / name
        if name != Path(name).name or not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != size:
            return f"{name} has {path.stat().st_size:,} bytes instead of {size:,}"
    return None
