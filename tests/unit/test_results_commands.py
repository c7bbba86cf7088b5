"""Every command bench/RESULTS.md prints runs at HEAD: each `triforce ...` and `python -m
triforce...` line (with its continuation lines) is parsed by its click command, subcommands
included, without running it. A renamed or removed flag fails here, not in a reader's shell.
Files a command names need not exist here (they are the reader's)."""
import importlib
import re
import shlex
from pathlib import Path

import click
import pytest

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "RESULTS.md"


def printed_commands(text: str) -> list[str]:
    """Indented command lines of the page, continuation lines joined."""
    commands, current = [], None
    for line in text.splitlines():
        stripped = line.strip()
        if current is not None:
            current += " " + stripped.rstrip("\\").strip()
            if not stripped.endswith("\\"):
                commands.append(current)
                current = None
            continue
        if line.startswith("    ") and re.match(r"(triforce |python -m triforce)", stripped):
            if stripped.endswith("\\"):
                current = stripped.rstrip("\\").strip()
            else:
                commands.append(stripped)
    return commands


def command_of(words: list[str]) -> tuple[click.Command, list[str]]:
    if words[0] == "triforce":
        from triforce.cli.main import cli
        return cli, words[1:]
    assert words[:2] == ["python", "-m"], words
    module = importlib.import_module(words[2])
    return module.main, words[3:]


def parse(command: click.Command, args: list[str], name: str) -> None:
    """click's parsing of `args` (and a group's subcommand's), with nothing invoked."""
    ctx = command.make_context(name, list(args))
    if isinstance(command, click.Group):
        rest = [*ctx._protected_args, *ctx.args]
        sub_name, sub, sub_args = command.resolve_command(ctx, rest)
        parse(sub, sub_args, sub_name)


COMMANDS = printed_commands(RESULTS.read_text())


def test_the_page_prints_commands():
    assert len(COMMANDS) >= 8 and any(c.startswith("python -m triforce.bench.gpu_campaign") for c in COMMANDS)


@pytest.mark.parametrize("line", COMMANDS)
def test_a_printed_command_parses_at_head(line):
    words = shlex.split(line.split("  #")[0])
    command, args = command_of(words)
    try:
        parse(command, args, words[0])
    except click.BadParameter as e:
        if "does not exist" not in str(e):  # a reader's file, absent here: the flag itself parsed
            raise


def test_a_removed_flag_fails_the_check():
    command, args = command_of(shlex.split("triforce bench offload --arch tiny-test --context 600 --quick"))
    with pytest.raises(click.NoSuchOption, match="--quick"):
        parse(command, args, "triforce")


def test_triforce_bench_lists_the_module_benchmarks_without_loading_torch():
    from cli_json import run_python
    from triforce.cli.bench_cmd import MODULE_BENCHES

    code = ("import sys; from triforce.cli.main import cli\n"
            "try:\n    cli.main(['bench', '--help'], prog_name='triforce', standalone_mode=False)\n"
            "except SystemExit:\n    pass\n"
            "assert 'torch' not in sys.modules, 'bench --help loaded torch'")
    listed = [line.split()[0] for line in run_python(code).split("Commands:")[1].splitlines() if line.startswith("  ")
              and not line.startswith("    ")]
    assert listed == sorted(["offload", "batch", *MODULE_BENCHES])


def test_a_module_benchmark_runs_as_a_triforce_bench_command(capsys):
    from cli_json import run_json

    report = run_json(capsys, "bench", "kernels", "--arch", "llama-68m", "--rows", "1", "--formats", "q8_0",
                      "--dtype", "float32", "--repeats", "1", "--json")
    assert {r["weights"] for r in report["rows"]} == {"float", "q8_0"} and report["provenance"]["commit"]


def test_a_tile_sweep_is_a_gpus_and_says_so(capsys):
    from triforce.cli.main import main

    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "kernels", "--arch", "llama-68m", "--tiles", "32:8:4:2:4", "--device", "cpu"])
    assert exit_info.value.code == 2 and "a GPU's" in capsys.readouterr().err


def test_a_tile_table_is_written_from_a_sweep_only(capsys, tmp_path):
    from triforce.cli.main import main

    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "kernels", "--arch", "llama-68m", "--write-table", str(tmp_path / "t.json")])
    assert exit_info.value.code == 2 and "give --tiles" in capsys.readouterr().err
