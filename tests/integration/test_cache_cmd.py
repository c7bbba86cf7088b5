"""`triforce cache` lists the cache folder's entries and `prune` removes exactly the stale ones:
an older triforce's float32 copy, a model whose GGUF file is gone, kernels of other sources, an
index no file matches, a build killed over a day ago; what is in use or unknown stays."""
import json
import os
import time

from test_cli import run_cli


def _entry(folder, files: dict[str, bytes], source=None, made_by=None):
    from triforce.model.cache_entry import record_sizes
    from triforce.model.gguf_convert import conversion_digest
    from triforce.model.gguf_weights import GgufSource

    folder.mkdir(parents=True)
    for name, data in files.items():
        (folder / name).write_bytes(data)
    if source is not None:
        GgufSource.of(source, "llama", 4, 2, conversion_digest() if made_by is None else made_by).write(folder)
    record_sizes(folder)
    return folder


def test_list_and_prune_remove_exactly_the_stale_entries(tmp_path, monkeypatch, capsys):
    from triforce.numba_cache import source_digest

    cache = tmp_path / "cache"
    monkeypatch.setenv("TRIFORCE_CACHE", str(cache))
    kept_file, gone_file = tmp_path / "kept.gguf", tmp_path / "gone.gguf"
    kept_file.write_bytes(b"g" * 1000)
    gone_file.write_bytes(b"g" * 10)
    stat = kept_file.stat()
    in_use = {
        _entry(cache / "converted" / "kept-1", {"config.json": b"{}"}, source=kept_file),
        cache / "numba" / source_digest(),
        cache / "gguf-index" / f"kept-{stat.st_size}-{stat.st_mtime_ns}.json",
        cache / ".partial-being-built-now",
        cache / "notes.txt",
    }
    stale = {
        _entry(cache / "models" / "smollm2-135m-instruct", {"config.json": b"{}", "model.safetensors": b"w" * 5000}),
        _entry(cache / "converted" / "gone-2", {"config.json": b"{}"}, source=gone_file),
        _entry(cache / "converted" / "kept-by-older-reading", {"config.json": b"{}"}, source=kept_file, made_by=""),
        cache / "numba" / "0123456789abcdef",
        cache / "gguf-index" / "other-10-99.json",
        cache / "converted" / ".partial-killed-long-ago",
    }
    gone_file.unlink()
    for path in (cache / "numba" / source_digest(), cache / "numba" / "0123456789abcdef"):
        path.mkdir(parents=True)
        (path / "kernel.nbc").write_bytes(b"k" * 300)
    for path in (*[p for p in in_use | stale if p.suffix == ".json"], cache / ".partial-being-built-now",
                 cache / "notes.txt", cache / "converted" / ".partial-killed-long-ago"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"version": 1, "tensors": []}) if path.suffix == ".json" else "x")
    day_ago = time.time() - 2 * 86400
    os.utime(cache / "converted" / ".partial-killed-long-ago", (day_ago, day_ago))

    code, out, _ = run_cli(capsys, "cache", "--json")
    listed = json.loads(out)
    assert code == 0 and listed["folder"] == str(cache)
    assert {e["path"] for e in listed["entries"]} == {str(p) for p in in_use | stale}
    assert {e["path"] for e in listed["entries"] if e["stale"]} == {str(p) for p in stale}
    float_copy = next(e for e in listed["entries"] if e["path"].endswith("smollm2-135m-instruct"))
    assert "older triforce's float32 copy" in float_copy["stale"] and float_copy["bytes"] > 5000
    older = next(e for e in listed["entries"] if e["path"].endswith("kept-by-older-reading"))
    assert older["stale"] == "made by another version of triforce's GGUF reading"

    code, out, _ = run_cli(capsys, "cache")
    assert code == 0 and "STALE: an older triforce's float32 copy" in out and "`triforce cache prune`" in out
    code, out, _ = run_cli(capsys, "cache", "prune", "--dry-run")
    assert code == 0 and out.count("would remove") == len(stale) and all(p.exists() for p in stale)
    code, out, _ = run_cli(capsys, "cache", "prune")
    assert code == 0 and out.count("removed") == len(stale) and "freed" in out
    assert not any(p.exists() for p in stale) and all(p.exists() for p in in_use)
    code, out, _ = run_cli(capsys, "cache", "prune")
    assert code == 0 and out.strip() == "nothing stale to remove"


def test_an_empty_or_missing_cache_folder_lists_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TRIFORCE_CACHE", str(tmp_path / "none"))
    code, out, _ = run_cli(capsys, "cache")
    assert code == 0 and "0.0 MB in 0 entries" in out and not (tmp_path / "none").exists()
