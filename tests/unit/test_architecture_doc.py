"""docs/ARCHITECTURE.md stays true: every file or folder it names exists, and every package the
layering test rules over is on its map."""
import re

from test_layering import ALLOWED, ROOT

DOC = ROOT / "docs" / "ARCHITECTURE.md"


def named_paths(text: str) -> set[str]:
    """Paths in backticks: `folder/file.py` or `folder/`, with at most one flag-free word."""
    return {m for m in re.findall(r"`([\w./-]+/[\w./-]*)`", text) if not m.startswith("-")}


def test_every_path_the_architecture_names_exists():
    text = DOC.read_text()
    paths = named_paths(text)
    assert len(paths) > 30  # the doc names its files: this test reads them
    # core packages may be named from the package root (`decoding/engine.py`)
    missing = sorted(p for p in paths if not (ROOT / p).exists() and not (ROOT / "triforce_core" / p).exists())
    assert not missing, missing


def test_every_package_of_the_layering_rules_is_on_the_map():
    text = DOC.read_text()
    packages = {folder.removeprefix("triforce_core/") for folder in ALLOWED} | {"app", "server", "cli"}
    assert not sorted(p for p in packages if f"{p}/" not in text)
