"""numba's cache folder follows the kernels' sources (numba alone checks a function's own file)."""
import os

from triforce import numba_cache


def test_digest_changes_with_any_source_file(tmp_path):
    a, b = tmp_path / "kernels", tmp_path / "pinned"
    a.mkdir(), b.mkdir()
    (a / "caller.py").write_text("def f(): return g()\n")
    (b / "callee.py").write_text("def g(): return 1\n")
    before = numba_cache.source_digest([a, b])
    assert numba_cache.source_digest([a, b]) == before
    (b / "callee.py").write_text("def g(): return 2\n")  # only the callee's file changes
    assert numba_cache.source_digest([a, b]) != before


def test_the_real_packages_are_found_and_digested():
    folders = numba_cache.source_folders()
    assert any((folder / "cpu" / "attention" / "decode.py").exists() for folder in folders)
    assert len(numba_cache.source_digest()) == 16


def test_digest_follows_files_in_subfolders(tmp_path):
    """kernels/cpu/ holds the numba code: a change there must name a new cache folder."""
    (tmp_path / "kernels" / "cpu").mkdir(parents=True)
    kernel = tmp_path / "kernels" / "cpu" / "kernel.py"
    kernel.write_text("def f(): return 1\n")
    before = numba_cache.source_digest([tmp_path / "kernels"])
    kernel.write_text("def f(): return 2\n")
    assert numba_cache.source_digest([tmp_path / "kernels"]) != before


def test_cache_folder_is_named_by_the_digest_and_old_ones_are_pruned(tmp_path, monkeypatch):
    """Only numba's files in folders named as triforce names them go; a user's file, a folder of
    another name and a link out of the cache stay (issue 71: the old prune removed every folder)."""
    import numba
    monkeypatch.delenv("NUMBA_CACHE_DIR", raising=False)
    monkeypatch.setattr(numba.config, "CACHE_DIR", numba.config.CACHE_DIR)  # restored after the test
    root = tmp_path / "numba"
    olds = [f"{i:016x}" for i in range(4)]
    for i, name in enumerate(olds):
        (root / name).mkdir(parents=True)
        (root / name / "f-12.py311.nbi").write_bytes(b"i")
        (root / name / "f-12.py311.1.nbc").write_bytes(b"c")
        (root / name / "linear_0a1b").mkdir()  # numba's subfolder per source folder
        (root / name / "linear_0a1b" / "blocks.g-33.py311.nbi").write_bytes(b"i")
        if i == 1:
            (root / name / "notes.txt").write_text("mine")
        os.utime(root / name, (1000 + i, 1000 + i))
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "x.nbc").write_bytes(b"not numba's here")
    (root / "0123456789abcdef").symlink_to(outside, target_is_directory=True)
    (root / "mine").mkdir()
    os.utime(root / "mine", (1, 1))
    folder = numba_cache.use_versioned_cache(root)
    assert folder == root / numba_cache.source_digest()
    assert os.environ["NUMBA_CACHE_DIR"] == str(folder) == numba.config.CACHE_DIR
    left = sorted(p.name for p in root.iterdir())
    assert left == sorted([folder.name, olds[1], olds[2], olds[3], "mine", "0123456789abcdef"])  # the newest kept
    assert [p.name for p in (root / olds[1]).iterdir()] == ["notes.txt"]
    assert (outside / "x.nbc").exists()


def test_a_users_numba_cache_dir_wins(tmp_path, monkeypatch):
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path / "mine"))
    assert numba_cache.use_versioned_cache(tmp_path / "numba") is None
    assert os.environ["NUMBA_CACHE_DIR"] == str(tmp_path / "mine")
    assert not (tmp_path / "numba").exists()
