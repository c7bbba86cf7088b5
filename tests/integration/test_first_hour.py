"""A new user's first hour: --threads reaches both kernel pools and the JSON, a long prefill
shows progress on stderr (never stdout or the JSON), an instruction model that ends at once on a
raw prompt gets a hint to use --chat, and flag values out of range exit 2."""
import json
import shutil

import numba
import pytest
import torch

from test_cli import run_cli


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads(), numba.get_num_threads()
    yield
    torch.set_num_threads(before[0])
    numba.set_num_threads(before[1])


def test_threads_reach_both_pools_and_the_json(capsys, tiny_model_dir, restore_threads):
    code, out, err = run_cli(capsys, "generate", "--model", str(tiny_model_dir("llama-gqa")), "--prompt", "the cat",
                             "--max-new-tokens", "3", "--threads", "1", "--json")
    assert code == 0, err
    assert json.loads(out)["threads"] == 1 == torch.get_num_threads() == numba.get_num_threads()


def test_too_many_threads_is_one_error_line(capsys, tiny_model_dir):
    code, _, err = run_cli(capsys, "generate", "--model", str(tiny_model_dir("llama-gqa")), "--prompt", "hi",
                           "--threads", "100000")
    assert code == 2 and "--threads" in err and len(err.strip().splitlines()) == 1


def test_a_long_prefill_shows_progress_on_stderr_only(capsys, tiny_model_dir, monkeypatch):
    from triforce.app import progress

    monkeypatch.setattr(progress, "PROGRESS_DELAY_S", 0.0)  # as if the prefill took long
    code, out, err = run_cli(capsys, "generate", "--model", str(tiny_model_dir("llama-gqa", max_position_embeddings=512)),
                             "--prompt", "the cat sat on the mat. " * 12, "--max-new-tokens", "2", "--json")
    assert code == 0, err
    assert "prefill" in err and "tok" in err
    summary = json.loads(out)  # stdout is the JSON alone
    assert "prefill" not in json.dumps({k: v for k, v in summary.items() if k not in ("prefill_s", "plan")})


@pytest.fixture(scope="module")
def ends_at_once(tiny_model_dir, tmp_path_factory):
    """A model with a chat template whose every token ends a sequence: it stops at once."""
    folder = tmp_path_factory.mktemp("instruct") / "model"
    shutil.copytree(tiny_model_dir("llama-gqa"), folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": list(range(config["vocab_size"]))}))
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    tokenizer_config["chat_template"] = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return str(folder)


def test_an_instruction_model_ending_at_once_suggests_chat(capsys, ends_at_once):
    code, out, err = run_cli(capsys, "generate", "--model", ends_at_once, "--prompt", "Write one sentence.", "--json")
    assert code == 0, err
    assert json.loads(out)["stopped_by"] == "eos" and "try --chat" in err
    code, out, err = run_cli(capsys, "generate", "--model", ends_at_once, "--prompt", "Write one sentence.", "--chat",
                             "--json")
    assert code == 0 and "try --chat" not in err


@pytest.mark.parametrize("flags", [["--temperature", "-1"], ["--top-p", "0"], ["--top-p", "1.5"],
                                   ["--temperature", "nan"]])
def test_flag_values_out_of_range_exit_2(capsys, tiny_model_dir, flags):
    code, _, err = run_cli(capsys, "generate", "--model", str(tiny_model_dir("llama-gqa")), "--prompt", "hi", *flags)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err
