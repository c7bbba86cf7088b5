"""Dependencies point one way: role folders import only below themselves, offload/ only the
core's configuration, error and contract types, pinned/ and kernels/ nothing of the core."""
import ast
from pathlib import Path

import pytest

import triforce

ROOT = Path(triforce.__file__).resolve().parent.parent
# folder -> the triforce modules (prefixes) it may import
ALLOWED = {
    "kernels": ("triforce.kernels",),
    "pinned": ("triforce.pinned", "triforce.kernels"),
    "offload": ("triforce.offload", "triforce.pinned", "triforce.kernels", "triforce.config", "triforce.errors",
                "triforce.cache_contract", "triforce.profiles"),
    "triforce_core/model": ("triforce.model", "triforce.config", "triforce.errors", "triforce.paths",
                            "triforce.cache_contract", "triforce.kernels", "triforce.offload"),
    "triforce_core/cache": ("triforce.cache", "triforce.model", "triforce.config", "triforce.errors",
                            "triforce.cache_contract", "triforce.kernels", "triforce.offload", "triforce.pinned"),
    "triforce_core/decoding": ("triforce.decoding", "triforce.cache", "triforce.model", "triforce.config",
                               "triforce.errors", "triforce.cache_contract", "triforce.kernels", "triforce.offload",
                               "triforce.pinned"),
}


def imports_of(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return {n for n in names if n == "triforce" or n.startswith("triforce.")}


@pytest.mark.parametrize("folder", sorted(ALLOWED))
def test_no_import_goes_upward(folder):
    bad = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        for name in imports_of(path):
            if not any(name == p or name.startswith(p + ".") for p in ALLOWED[folder]):
                bad.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not bad, bad


def test_no_source_file_is_over_300_lines():
    long = [f"{p.relative_to(ROOT)}: {n}" for folder in ("triforce_core", "offload", "pinned", "kernels", "bench")
            for p in (ROOT / folder).rglob("*.py") if (n := len(p.read_text().splitlines())) > 300]
    assert not long, long
