"""The command line as a user meets it: JSON output, and one-line errors for bad input."""
import json
import os
import subprocess
import sys

import click
import pytest

from triforce.cli.main import cli, main


def run_cli(capsys, *args):
    with pytest.raises(SystemExit) as exit_info:
        main(list(args))
    out, err = capsys.readouterr()
    return exit_info.value.code, out, err


def assert_one_line_error(code, err, *fragments):
    assert code != 0
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("triforce: error:"), err
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def test_version(capsys):
    code, out, _ = run_cli(capsys, "--version")
    assert code == 0 and "triforce" in out


def test_generate_json_default_model_says_paris(capsys, default_model_dir):
    code, out, _ = run_cli(capsys, "generate", "--model", "default", "--prompt", "The capital of France is",
                           "--max-new-tokens", "8", "--temperature", "0", "--json")
    assert code == 0
    result = json.loads(out)
    assert "Paris" in result["text"]
    assert len(result["tokens"]) == 8 and result["prompt_tokens"] == 5 and result["method"] == "ar"
    assert result["time_s"] > 0 and result["tokens_per_s"] > 0


def test_generate_streams_text_and_stats(capsys, tiny_model_dir):
    code, out, err = run_cli(capsys, "generate", "--model", str(tiny_model_dir("llama-gqa")),
                             "--prompt", "hello", "--max-new-tokens", "5", "--ignore-eos")
    assert code == 0 and len(out.strip()) > 0 and "5 tokens" in err


def test_prompt_file_and_sampling_seed(capsys, tiny_model_dir, tmp_path):
    prompt = tmp_path / "p.txt"
    prompt.write_text("abc def")
    args = ["generate", "--model", str(tiny_model_dir("qwen2")), "--prompt-file", str(prompt),
            "--max-new-tokens", "12", "--temperature", "0.9", "--seed", "7", "--ignore-eos", "--json"]
    first = json.loads(run_cli(capsys, *args)[1])["tokens"]
    second = json.loads(run_cli(capsys, *args)[1])["tokens"]
    assert first == second and len(first) == 12


def test_runtime_flags_keep_the_tokens_and_report_what_ran(capsys, tiny_model_dir):
    base = ["generate", "--model", str(tiny_model_dir("llama-gqa")), "--prompt", "the cat sat on the mat. the cat",
            "--method", "triforce", "--budget", "24", "--chunk-size", "4", "--max-new-tokens", "16", "--ignore-eos",
            "--dtype", "float64", "--json"]
    plain = json.loads(run_cli(capsys, *base)[1])
    tuned = json.loads(run_cli(capsys, *base, "--attn", "sdpa", "--no-graphs", "--count-syncs")[1])
    assert tuned["tokens"] == plain["tokens"]
    assert tuned["attention"] == plain["attention"] == "sdpa"
    assert plain["drafting_runner"] == tuned["drafting_runner"] == "eager"  # no CUDA: nothing to capture
    assert tuned["host_syncs"] == "counted on CUDA only" and "host_syncs" not in plain
    code, _, err = run_cli(capsys, *base, "--attn", "flash")
    assert_one_line_error(code, err, "--attn flash")


BAD_FLAGS = [
    (["--max-new-tokens", "-3"], "--max-new-tokens"),
    (["--temperature", "-0.5"], "temperature"),
    (["--top-p", "0"], "top-p"),
    (["--top-p", "1.5"], "top-p"),
    (["--top-k", "-1"], "top-k"),
    (["--max-new-tokens", "many"], "many"),
    (["--method", "magic"], "magic"),
    (["--method", "naive", "--draft", "none"], "needs a draft"),
    (["--method", "triforce", "--budget", "8"], "--budget"),
    (["--method", "triforce", "--gamma2", "0"], "--gamma2"),
    (["--method", "ar", "--draft", "/some/model"], "--draft"),
]


@pytest.mark.parametrize("flags,fragment", BAD_FLAGS)
def test_invalid_flag_values(capsys, tiny_model_dir, flags, fragment):
    model = str(tiny_model_dir("llama-gqa"))
    capsys.readouterr()  # the first build of the model prints its progress
    code, _, err = run_cli(capsys, "generate", "--model", model, "--prompt", "hi", *flags)
    assert_one_line_error(code, err, fragment)


def test_missing_model_path(capsys, tmp_path):
    code, _, err = run_cli(capsys, "generate", "--model", str(tmp_path / "nope"), "--prompt", "hi")
    assert_one_line_error(code, err, "does not exist")


def test_folder_that_is_not_a_model(capsys, tmp_path):
    code, _, err = run_cli(capsys, "generate", "--model", str(tmp_path), "--prompt", "hi")
    assert_one_line_error(code, err, "config.json")


def test_unsupported_architecture(capsys, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 2}))
    code, _, err = run_cli(capsys, "generate", "--model", str(tmp_path), "--prompt", "hi")
    assert_one_line_error(code, err, "unsupported architecture", "gpt2")


def copy_model(src, dst):
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_truncated_weights(capsys, tiny_model_dir, tmp_path):
    folder = copy_model(tiny_model_dir("llama-gqa"), tmp_path / "m")
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    code, _, err = run_cli(capsys, "generate", "--model", str(folder), "--prompt", "hi")
    assert_one_line_error(code, err, "model.safetensors")


def test_corrupt_weights(capsys, tiny_model_dir, tmp_path):
    folder = copy_model(tiny_model_dir("llama-gqa"), tmp_path / "m")
    (folder / "model.safetensors").write_bytes(b"\x00garbage" * 100)
    code, _, err = run_cli(capsys, "generate", "--model", str(folder), "--prompt", "hi")
    assert_one_line_error(code, err, "corrupt")


def test_corrupt_gguf(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("TRIFORCE_CACHE", str(tmp_path / "cache"))
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\x01" * 64)
    code, _, err = run_cli(capsys, "generate", "--model", str(bad), "--prompt", "hi")
    assert_one_line_error(code, err, "GGUF")
    assert not list((tmp_path / "cache" / "converted").glob("broken*"))  # nothing half-written kept


def test_prompt_longer_than_context(capsys, tiny_model_dir):
    folder = tiny_model_dir("llama-gqa")  # 128-token context, one token per character
    code, _, err = run_cli(capsys, "generate", "--model", str(folder), "--prompt", "a" * 300)
    assert_one_line_error(code, err, "300", "128")


def test_both_or_no_prompt(capsys, tiny_model_dir):
    code, _, err = run_cli(capsys, "generate", "--model", str(tiny_model_dir("llama-gqa")))
    assert_one_line_error(code, err, "--prompt")


def test_installed_console_script_end_to_end(tiny_model_dir):
    """The real `triforce` executable: exit codes and no traceback, in a separate process."""
    exe = os.path.join(os.path.dirname(sys.executable), "triforce")
    ok = subprocess.run([exe, "generate", "--model", str(tiny_model_dir("llama-gqa")), "--prompt", "hi",
                         "--max-new-tokens", "3", "--json"], capture_output=True, text=True)
    assert ok.returncode == 0 and json.loads(ok.stdout)["new_tokens"] <= 3
    bad = subprocess.run([exe, "generate", "--prompt", "hi", "--temperature", "-1"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr and len(bad.stderr.strip().splitlines()) == 1


def test_truncated_gguf(capsys, tmp_path, monkeypatch, default_model_dir):
    from triforce.model.default_model import ensure_gguf
    source = ensure_gguf()  # the real default GGUF, from the shared cache
    cut = tmp_path / "cut.gguf"
    with open(source, "rb") as f:
        cut.write_bytes(f.read(source.stat().st_size // 2))
    monkeypatch.setenv("TRIFORCE_CACHE", str(tmp_path / "cache"))
    code, _, err = run_cli(capsys, "generate", "--model", str(cut), "--prompt", "hi")
    assert_one_line_error(code, err, "cut.gguf", "truncated")


def _commands(group, path=()):
    for name, command in group.commands.items():
        yield path + (name,)
        if isinstance(command, click.Group):
            yield from _commands(command, path + (name,))


def test_every_help_is_free_of_machine_bounds(capsys):
    """Integer flags are bounded (one error line instead of an overflow in torch), but those bounds
    are no news to a user in every flag's help (a port's 0-65535 is, and stays)."""
    commands = list(_commands(cli))
    assert ("bench", "offload") in commands and ("eval", "needle") in commands
    for path in commands:
        code, out, _ = run_cli(capsys, *path, "--help")
        assert code == 0 and "Usage:" in out, path
        assert "2147483647" not in out and "18446744073709551615" not in out, (path, out)
