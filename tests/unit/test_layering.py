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


def test_only_the_cli_imports_the_cli():
    """cli/ parses flags and prints; the use cases live in app/, server/ and bench/, which never
    reach up into it (a benchmark once imported the server's assembly from the CLI)."""
    bad = [f"{path.relative_to(ROOT)} imports {name}"
           for folder in ("triforce_core", "offload", "pinned", "kernels", "bench")
           for path in sorted((ROOT / folder).rglob("*.py")) if "cli" not in path.relative_to(ROOT).parts
           for name in imports_of(path) if name == "triforce.cli" or name.startswith("triforce.cli.")]
    assert not bad, bad


def test_the_cli_starts_without_torch():
    """--help, --version, profile list and flag errors answer at once: importing the command line
    loads no torch, transformers or numba (they took 4 s before any output)."""
    import subprocess
    import sys

    code = ("import sys, triforce.cli.main; "
            "print(sorted(m for m in ('torch', 'transformers', 'numba') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_idle_kernel_threads_sleep_unless_told_to_spin():
    """Importing triforce (before torch) makes both OpenMP runtimes' idle threads sleep: spinning
    ones took the cores a second busy program needed (bench/contention.py)."""
    import os
    import subprocess
    import sys

    code = "import os, triforce; print(os.environ.get('OMP_WAIT_POLICY'))"
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "TRIFORCE_THREAD_WAIT")}
    sleeping = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    spinning = subprocess.run([sys.executable, "-c", code], env={**env, "TRIFORCE_THREAD_WAIT": "spin"},
                              capture_output=True, text=True, timeout=60)
    assert sleeping.stdout.strip() == "PASSIVE" and spinning.stdout.strip() == "None"
