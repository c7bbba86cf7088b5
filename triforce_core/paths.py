"""Where triforce keeps downloaded and converted models, how it writes a file it will trust later
(a profile, an acceptance trace): whole or not at all, and how it reads one it did not write (a
config, a manifest): with a bound, and never outside the store it belongs to."""
import os
import tempfile
from pathlib import Path


def cache_root() -> Path:
    """`$TRIFORCE_CACHE`, else `~/.cache/triforce`."""
    root = os.environ.get("TRIFORCE_CACHE")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "triforce"


def write_atomically(path, text: str) -> None:
    """Write `text` to a temporary file beside `path`, flush it to disk, then rename it over
    `path`: a write cut short (a full disk, a kill) leaves the old file as it was. OSError as
    open() raises it."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


METADATA_LIMIT = 16 << 20  # a config, index or manifest; a 405B model's shard index is ~2 MB


def read_small(path, what: str, limit: int = METADATA_LIMIT) -> str:
    """The text of a metadata file (a config, an index, a manifest), read with a bound: a file
    larger than `limit` bytes, or one that cannot be read, is a UserError naming `what` it was."""
    from triforce.errors import UserError

    try:
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    except OSError as e:
        raise UserError(f"cannot read {what} {path}: {e.strerror or e}") from None
    if len(data) > limit:
        raise UserError(f"{what} {path} is larger than {limit >> 20} MiB, far beyond any real one: not reading it")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{what} {path} is not UTF-8 text: {e}") from None


def inside(path, store) -> bool:
    """`path` lies in `store`, both taken as written (no link followed), `..` folded."""
    return Path(os.path.normpath(path)).is_relative_to(os.path.normpath(store))


def shown(name: str, limit: int = 80) -> str:
    """A name as an error line shows it: cut to `limit` characters."""
    return name if len(name) <= limit else name[:limit] + f"... ({len(name)} characters)"


def remove_files(folder, files) -> None:
    """Unlink `files` (a link is removed, never followed), then every folder under `folder`, and
    `folder` itself, that this left empty: what else is there stays, with the folders holding it."""
    for path in files:
        Path(path).unlink(missing_ok=True)
    for where, dirs, _ in os.walk(folder, topdown=False):
        for name in dirs:
            if not os.path.islink(os.path.join(where, name)):
                _rmdir_if_empty(os.path.join(where, name))
    _rmdir_if_empty(folder)


def _rmdir_if_empty(path) -> None:
    try:
        os.rmdir(path)
    except OSError:
        pass  # not empty: it holds what is not ours to remove
