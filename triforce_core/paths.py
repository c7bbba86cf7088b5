"""Where triforce keeps downloaded and converted models, and how it writes a file it will trust
later (a profile, an acceptance trace): whole or not at all."""
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
