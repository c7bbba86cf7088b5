"""Dependencies point one way: role folders import only below themselves, offload/ only the
core's configuration, error and contract types, plan/ those and offload/, pinned/ and kernels/
nothing of the core."""
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
                "triforce.cache_contract"),
    # planning sits on what moves the bytes (offload/'s hybrid rates, shapes, errors) and the
    # shipped profiles; the caches and the engine read its plans and cost model
    "triforce_core/plan": ("triforce.plan", "triforce.offload", "triforce.pinned", "triforce.kernels",
                           "triforce.config", "triforce.errors", "triforce.profiles"),
    # tensor parallelism's sharding is a transform of the model (model/tensor_parallel.py); launching
    # the ranks is app/'s: model/ imports no plan/, which plans for it
    "triforce_core/model": ("triforce.model", "triforce.config", "triforce.errors", "triforce.paths",
                            "triforce.cache_contract", "triforce.kernels"),
    "triforce_core/cache": ("triforce.cache", "triforce.model", "triforce.config", "triforce.errors",
                            "triforce.cache_contract", "triforce.kernels", "triforce.offload", "triforce.pinned"),
    "triforce_core/decoding": ("triforce.decoding", "triforce.cache", "triforce.model", "triforce.config",
                               "triforce.errors", "triforce.paths", "triforce.cache_contract", "triforce.kernels", "triforce.offload",
                               "triforce.pinned", "triforce.plan"),
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


SOURCE = ("triforce_core", "offload", "pinned", "kernels", "bench")
MAX_FUNCTION_LINES = 60
MAX_FILE_LINES = 500  # a smell to look at (a file holding two concepts), not a size to squeeze a file to
# the functions allowed past MAX_FUNCTION_LINES, each with why it reads best whole
LONG_FUNCTIONS = {
    "kernels/cpu/attention/bf16_key_pairs.py:score_rows":
        "a numba @intrinsic: the LLVM IR it emits is built inside it, closing over the literal row count",
    "bench/campaign/steps.py:steps": "the GPU campaign's steps as one list, in the order a lease runs them",
    "bench/campaign/desktop.py:desktop_steps": "the 2026 desktop's steps as one list, in the order they run",
}


def function_lengths() -> dict[str, int]:
    """'folder/file.py:name' -> lines (decorators left out) of every function in the source."""
    lengths = {}
    for folder in SOURCE:
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    name = f"{path.relative_to(ROOT)}:{node.name}"
                    lengths[name] = max(lengths.get(name, 0), node.end_lineno - node.lineno + 1)
    return lengths


def test_functions_are_short_but_the_named_few():
    lengths = function_lengths()
    long = {name: n for name, n in lengths.items() if n > MAX_FUNCTION_LINES}
    assert not set(long) - set(LONG_FUNCTIONS), {n: long[n] for n in set(long) - set(LONG_FUNCTIONS)}
    # a named exception cut short since (or gone) leaves the list
    assert not set(LONG_FUNCTIONS) - set(long), set(LONG_FUNCTIONS) - set(long)


def test_no_source_file_is_over_500_lines():
    long = [f"{p.relative_to(ROOT)}: {n}" for folder in SOURCE
            for p in (ROOT / folder).rglob("*.py") if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES]
    assert not long, long


def test_only_the_cli_imports_the_cli():
    """cli/ parses flags and prints; the use cases live in app/, server/ and bench/, which never
    reach up into it (a benchmark once imported the server's assembly from the CLI)."""
    bad = [f"{path.relative_to(ROOT)} imports {name}"
           for folder in SOURCE
           for path in sorted((ROOT / folder).rglob("*.py")) if "cli" not in path.relative_to(ROOT).parts
           for name in imports_of(path) if name == "triforce.cli" or name.startswith("triforce.cli.")]
    assert not bad, bad


def test_the_app_layer_never_reaches_up():
    """app/ (the use cases and the Python API, triforce.LLM) sits under the server, the command
    line and the benchmarks, which build on it: it imports none of them."""
    above = ("triforce.server", "triforce.cli", "triforce.bench")
    bad = [f"{path.relative_to(ROOT)} imports {name}" for path in sorted((ROOT / "triforce_core" / "app").rglob("*.py"))
           for name in imports_of(path) if any(name == a or name.startswith(a + ".") for a in above)]
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


def test_idle_kernel_threads_spin_only_where_the_cores_were_idle():
    """Importing triforce (before torch) sets how both OpenMP runtimes' idle threads wait: spinning
    where this process's cores were idle (sleeping ones halved a quiet machine's decoding), sleeping
    where another program used them (spinning ones took its cores), or as TRIFORCE_THREAD_WAIT or
    an OMP_WAIT_POLICY already set says."""
    import os
    import subprocess
    import sys

    from triforce.thread_wait import QUIET_CORES, decide

    for others, policy in ((0.0, None), (QUIET_CORES + 0.5, "PASSIVE")):
        env = {}
        assert decide(env, others=lambda: others) == ("spin" if policy is None else "sleep")
        assert env.get("OMP_WAIT_POLICY") == policy
    for wait, policy in (("sleep", "PASSIVE"), ("spin", None)):
        env = {"TRIFORCE_THREAD_WAIT": wait}
        decide(env, others=lambda: pytest.fail("measured though told"))
        assert env.get("OMP_WAIT_POLICY") == policy
    env = {"OMP_WAIT_POLICY": "ACTIVE", "TRIFORCE_THREAD_WAIT": "sleep"}
    assert decide(env, others=lambda: 0.0) == "spin" and env["OMP_WAIT_POLICY"] == "ACTIVE"
    code = "import os, triforce; print(os.environ.get('OMP_WAIT_POLICY'), triforce.THREAD_WAIT)"
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "TRIFORCE_THREAD_WAIT")}
    for wait, printed in (("sleep", "PASSIVE sleep"), ("spin", "None spin")):
        done = subprocess.run([sys.executable, "-c", code], env={**base, "TRIFORCE_THREAD_WAIT": wait},
                              capture_output=True, text=True, timeout=60)
        assert done.stdout.strip() == printed
    done = subprocess.run([sys.executable, "-c", code], env=base, capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() in ("PASSIVE sleep", "None spin")  # auto: as the cores were


SOURCE_PACKAGES = {"triforce": "triforce_core", "triforce.offload": "offload", "triforce.pinned": "pinned",
                   "triforce.kernels": "kernels", "triforce.bench": "bench"}


def module_files() -> dict[str, Path]:
    """Every importable module of the project by its dotted name (a package by its __init__)."""
    found = {}
    for package, folder in SOURCE_PACKAGES.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join([package, *parts])] = path
    return found


def imported_modules(path: Path, modules: dict) -> set[str]:
    """The project modules `path` imports anywhere in it: `from P import x` imports package P (its
    __init__ runs) and, where x is a submodule, P.x too."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names & modules.keys()


def test_no_import_cycle_between_modules():
    """A cycle (kernels/__init__ re-exporting attention, which imported from kernels) works only by
    the order things happen to load; none is left, lazy imports inside functions included."""
    modules = module_files()
    graph = {name: imported_modules(path, modules) - {name} for name, path in modules.items()}
    cycles, state = [], {}

    def visit(name: str, stack: list[str]) -> None:
        state[name] = "open"
        for other in sorted(graph[name]):
            if state.get(other) == "open":
                cycles.append(stack[stack.index(other):] + [name, other] if other in stack else [name, other])
            elif other not in state:
                visit(other, stack + [name])
        state[name] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [])
    assert not cycles, cycles
