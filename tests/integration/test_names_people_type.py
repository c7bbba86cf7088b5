"""Issue 75: the names and numbers people type work: `--context 128K` (and 32k, 1M, in every
token count and list of them), `--arch` as a Hugging Face repo or an Ollama name of a known
architecture, and every `--model` help naming each form a model may take."""
import click
import pytest

from test_cli import run_cli
from triforce.cli.main import cli


@pytest.mark.parametrize("arch, context, expected", [
    ("meta-llama/Llama-3.1-8B-Instruct", "128K", ("llama3.1-8b", 131072)),
    ("qwen3:32b", "32k", ("qwen3-32b-128k", 32768)),
    ("Qwen/Qwen3-8B-GGUF", "131072", ("qwen3-8b-128k", 131072)),
    ("google/gemma-3-27b-it", "1M", ("gemma3-27b", 1 << 20)),
    ("llama3.1-8b", "64K", ("llama3.1-8b", 65536)),
])
def test_plan_takes_hugging_face_and_ollama_names_and_k_counts(capsys, arch, context, expected):
    code, out, err = run_cli(capsys, "plan", "--arch", arch, "--context", context, "--profile", "rtx4090-24g")
    assert f"plan: {expected[0]} (shapes only)" in out and f"context {expected[1]} tokens" in out, out + err


@pytest.mark.parametrize("args, message", [
    (("plan", "--arch", "llama3.1-8b", "--context", "12xK"), "'12xK' is not a valid integer (a count may end in K or M"),
    (("plan", "--arch", "llama3.1-8b", "--context", "1.5K"), "'1.5K' is not a valid integer"),
    (("plan", "--arch", "Llama-9B", "--context", "4K"), "unknown architecture 'Llama-9B' (known: llama2-7b-128k"),
])
def test_bad_names_and_counts_are_one_line_errors(capsys, args, message):
    code, out, err = run_cli(capsys, *args)
    assert code != 0 and message in err and len(err.strip().splitlines()) == 1, err


def test_a_list_of_counts_takes_k_too():
    from triforce.cli.options import int_list

    assert int_list("2K,8k,131072", "--contexts") == [2048, 8192, 131072]


def _commands(group: click.Group, prefix=()):
    for name, command in group.commands.items():
        if isinstance(command, click.Group):
            yield from _commands(command, (*prefix, name))
        else:
            yield (*prefix, name), command


def test_every_model_flag_names_each_form_a_model_takes():
    seen = 0
    for path, command in _commands(cli):
        for param in command.params:
            if "--model" in getattr(param, "opts", ()):
                seen += 1
                for form in (".gguf", "ORG/NAME", "ollama:NAME", "'default'", "folder"):
                    assert form in (param.help or ""), f"triforce {' '.join(path)} --model: no {form}"
    assert seen >= 6
