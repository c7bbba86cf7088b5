"""What a measurement ran on: the commit of the checkout (or TRIFORCE_COMMIT where a copy has no
.git, as on a lent GPU machine)."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path


def git_commit(repo: Path | None = None) -> str:
    """HEAD of the checkout, with '+changes' when tracked files differ from it."""
    if os.environ.get("TRIFORCE_COMMIT"):
        return os.environ["TRIFORCE_COMMIT"]
    try:
        cwd = repo or Path.cwd()
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=cwd,
                               capture_output=True, text=True).stdout.strip()
        return head.stdout.strip() + ("+changes" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown (no git checkout: set TRIFORCE_COMMIT)"
