"""Issue 71: `triforce cache prune` removes only what triforce made. A user's files in the cache
folder stay, no link is followed out of it, an entry another process is writing is left, and
`--dry-run` lists exactly what a prune removes."""
import json
import os
import subprocess
import sys
import time

import pytest

from test_cli import run_cli


def _float_copy(folder, extra=None):
    """An older triforce's float32 copy of a GGUF (stale), as that version recorded it."""
    from triforce.model.cache_entry import record_sizes

    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"w" * 5000)
    record_sizes(folder)
    for name, text in (extra or {}).items():  # put there after triforce wrote it
        (folder / name).write_text(text)
    return folder


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("TRIFORCE_CACHE", str(root))
    return root


def _prune(capsys, *flags):
    code, out, _ = run_cli(capsys, "cache", "prune", *flags)
    assert code == 0, out
    return out


def test_files_a_user_put_in_the_cache_stay(cache, capsys):
    entry = _float_copy(cache / "models" / "old-copy", {"README.md": "my notes on this model"})
    mine = cache / "converted" / "my-notes"
    mine.mkdir(parents=True)
    (mine / "notes.txt").write_text("mine")
    (mine / "picture.png").write_bytes(b"\x89PNG")
    (cache / "models" / "todo.txt").parent.mkdir(parents=True, exist_ok=True)
    (cache / "models" / "todo.txt").write_text("mine")
    (cache / "gguf-index").mkdir()
    (cache / "gguf-index" / "holiday.json").write_text('{"places": ["x"]}')
    (cache / "gguf-index" / "m-1-2.partial").write_text("an index an older triforce was writing")
    old_kernels = cache / "numba" / "0123456789abcdef"
    old_kernels.mkdir(parents=True)
    (old_kernels / "f-1.py311.nbi").write_bytes(b"i")
    (old_kernels / "linear_0a1b").mkdir()  # numba's subfolder per source folder
    (old_kernels / "linear_0a1b" / "blocks.g-33.py311.1.nbc").write_bytes(b"c")
    (old_kernels / "keep-me.txt").write_text("mine")

    out = _prune(capsys)
    assert not (entry / "model.safetensors").exists() and not (entry / "config.json").exists()
    assert (entry / "README.md").read_text() == "my notes on this model"
    assert f"left {entry / 'README.md'}  (not triforce's)" in out
    assert (mine / "notes.txt").exists() and (mine / "picture.png").exists()
    assert (cache / "models" / "todo.txt").exists()
    assert (cache / "gguf-index" / "holiday.json").exists() and (cache / "gguf-index" / "m-1-2.partial").exists()
    assert not (old_kernels / "f-1.py311.nbi").exists() and not (old_kernels / "linear_0a1b").exists()
    assert (old_kernels / "keep-me.txt").exists()
    code, listed, _ = run_cli(capsys, "cache", "--json")
    foreign = {e["path"] for e in json.loads(listed)["entries"] if "not triforce's" in e["what"]}
    assert {str(mine), str(cache / "models" / "todo.txt"), str(cache / "gguf-index" / "holiday.json")} <= foreign


def test_prune_never_follows_a_link_out_of_the_cache(cache, tmp_path, capsys):
    outside = tmp_path / "elsewhere"
    victim = _float_copy(outside / "converted" / "looks-stale")
    victim_too = _float_copy(outside / "an-entry")
    cache.mkdir()
    (cache / "converted").symlink_to(outside / "converted", target_is_directory=True)
    (cache / "models").mkdir()
    (cache / "models" / "linked").symlink_to(victim_too, target_is_directory=True)
    (cache / "numba").mkdir()
    (cache / "numba" / "0123456789abcdef").symlink_to(outside, target_is_directory=True)
    (outside / "x.nbc").write_bytes(b"k")

    _prune(capsys)
    assert (victim / "model.safetensors").exists() and (victim_too / "model.safetensors").exists()
    assert (outside / "x.nbc").exists()
    code, out, _ = run_cli(capsys, "cache")
    assert f"converted  a link to {outside / 'converted'}, outside the cache" in out


def _hold(lock):
    """Another process holding `lock`, as a writer building the entry would."""
    code = ("import sys; from filelock import FileLock; lock = FileLock(sys.argv[1]); lock.acquire(); "
            "print('held', flush=True); sys.stdin.read()")
    holder = subprocess.Popen([sys.executable, "-c", code, str(lock)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    assert holder.stdout.readline().strip() == "held"
    return holder


def test_an_entry_another_process_holds_is_left(cache, capsys):
    entry = _float_copy(cache / "converted" / "being-rebuilt")
    partial = cache / "converted" / ".partial-being-rebuilt-abc123"
    partial.mkdir()
    (partial / "tokenizer.json").write_text("half written")
    day_ago = time.time() - 2 * 86400
    os.utime(partial, (day_ago, day_ago))  # a slow build that has run for long: its lock says it runs
    holder = _hold(cache / "converted" / ".being-rebuilt.lock")
    try:
        dry = _prune(capsys, "--dry-run")
        out = _prune(capsys)
    finally:
        holder.stdin.close()
        holder.wait()
    assert (entry / "model.safetensors").exists() and (partial / "tokenizer.json").exists()
    assert f"left {entry}  (in use by another triforce process" in out and dry == out  # nothing else was stale
    out = _prune(capsys)  # the writer is done: now it goes
    assert not (entry / "model.safetensors").exists() and not partial.exists()


def test_dry_run_lists_exactly_what_prune_removes(cache, capsys):
    from triforce.numba_cache import source_digest

    _float_copy(cache / "models" / "a", {"mine.txt": "x"})
    _float_copy(cache / "converted" / "b")
    for digest in ("0123456789abcdef", source_digest()):
        (cache / "numba" / digest).mkdir(parents=True)
        (cache / "numba" / digest / "k-1.py311.nbc").write_bytes(b"k" * 300)
    (cache / "gguf-index").mkdir()
    (cache / "gguf-index" / "gone-1-2.json").write_text(json.dumps({"version": 1, "tensors": []}))
    before = {p for p in cache.rglob("*")}
    dry = _prune(capsys, "--dry-run")
    assert {p for p in cache.rglob("*")} == before  # nothing removed
    out = _prune(capsys)
    gone = before - {p for p in cache.rglob("*")}
    said = [line.split("  ")[1] for line in dry.splitlines() if line.startswith("would remove")]
    assert [line.replace("would remove", "removed").replace("would leave", "left").replace("would free", "freed")
            for line in dry.splitlines()] == out.splitlines()
    assert {str(p) for p in gone if p.parent.name in ("models", "converted", "numba", "gguf-index")} == set(said) - {
        str(cache / "models" / "a")}
    assert (cache / "models" / "a" / "mine.txt").exists() and (cache / "numba" / source_digest()).exists()
