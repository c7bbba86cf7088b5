"""Where triforce keeps downloaded and converted models."""
import os
from pathlib import Path


def cache_root() -> Path:
    """`$TRIFORCE_CACHE`, else `~/.cache/triforce`."""
    root = os.environ.get("TRIFORCE_CACHE")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "triforce"
