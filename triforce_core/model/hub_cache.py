"""`--model ORG/NAME[@REVISION]` from the Hugging Face cache, offline: the hub's own lookup (never
downloading; HF_HOME / HF_HUB_CACHE move the cache), the name and revision checked by the hub's
and git's grammars first, the snapshot found checked to be that repo's, its links into its blobs."""
from __future__ import annotations

import os
import re
from pathlib import Path

from triforce.errors import UserError
from triforce.paths import inside, read_small, shown

COMMIT = re.compile(r"[0-9a-f]{40}")
REF_LIMIT = 4096  # a ref file holds one commit hash


def check_revision(revision: str) -> None:
    """A branch, a tag (git's ref-name rules) or a commit; UserError otherwise."""
    parts = revision.split("/")
    bad = (not revision or len(revision) > 255 or ".." in revision or "@{" in revision or revision == "@"
           or revision.endswith((".", "/")) or re.search(r"[\x00-\x20\x7f~^:?*\[\\]", revision)
           or any(not part or part.startswith(".") or part.endswith(".lock") for part in parts))
    if bad:
        raise UserError(f"'{shown(revision)}' is not a revision (a branch, a tag or a 40-hex commit: git's "
                        "ref-name rules, no '..', no part starting with '.')")


def hf_snapshot(repo: str, revision: str | None = None) -> Path:
    """The snapshot folder of `repo` at `revision` in the Hugging Face cache, found by the hub's
    own offline lookup and checked to be that repo's snapshot, its files linked into its blobs."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(repo)
    except HFValidationError:
        raise UserError(f"'{shown(repo)}' is not a Hugging Face repo id (ORG/NAME: letters, digits, '-', '_' and "
                        "'.', 96 characters at most, no '--' or '..')") from None
    if revision is not None:
        check_revision(revision)
    storage = Path(constants.HF_HUB_CACHE) / f"models--{repo.replace('/', '--')}"
    if revision is not None and not COMMIT.fullmatch(revision):
        _check_ref(storage / "refs" / revision)
    try:
        folder = Path(snapshot_download(repo, revision=revision, local_files_only=True))
    except (LocalEntryNotFoundError, FileNotFoundError, ValueError):
        at = f"@{revision}" if revision else ""
        raise UserError(f"model '{repo}{at}' is neither a path here nor in the Hugging Face cache (looked in "
                        f"{constants.HF_HUB_CACHE}; "
                        f"triforce never downloads: with network run `hf download {repo}"
                        f"{' --revision ' + revision if revision else ''}`, or give a folder or .gguf path)") from None
    if folder.parent != storage / "snapshots" or not COMMIT.fullmatch(folder.name) or not inside(
            folder.resolve(), storage.resolve()):
        raise UserError(f"the Hugging Face cache's ref of '{repo}' leads to {folder}, outside its snapshots: "
                        f"a damaged cache (run `hf download {repo}` again)")
    _check_snapshot_links(folder, storage / "blobs")
    return folder


def _check_ref(ref: Path) -> None:
    """A ref file is read by the hub whole and its text joined into a path: bounded and checked here."""
    try:
        if not ref.is_file():
            return  # the hub's lookup says it is not there
        text = read_small(ref, "the Hugging Face ref", REF_LIMIT)
    except OSError as e:
        raise UserError(f"cannot read the Hugging Face ref {ref}: {e.strerror or e}") from None
    if not COMMIT.fullmatch(text.strip()):
        raise UserError(f"the Hugging Face ref {ref} holds no commit hash: a damaged cache")


def _check_snapshot_links(folder: Path, blobs: Path) -> None:
    """Each link in a snapshot leads into the repo's blobs, as the hub makes them (what a blob
    is, the user's store decides)."""
    for where, dirs, files in os.walk(folder):
        for name in dirs + files:
            path = Path(where) / name
            if path.is_symlink() and not inside(path.parent / os.readlink(path), blobs):
                raise UserError(f"{path} links outside its repo's blobs ({os.readlink(path)}): the Hugging Face cache "
                                "never makes such a link; give the file itself as a path if it is meant")
