"""The GPU campaign's user step on a CPU: the model it makes on the spot loads, chats through its
template, and triforce's greedy float32 tokens equal transformers' own generate (the check the
step makes on the GPU)."""
import json

import pytest

from triforce.bench.campaign.user_step import NEW_TOKENS, PROMPT, make_model, transformers_tokens
from triforce.cli.main import main


@pytest.fixture(scope="module")
def user_model(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("user-step") / "random-llama")


def test_greedy_float32_equals_transformers_on_the_made_model(user_model, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--model", str(user_model), "--prompt", PROMPT, "--max-new-tokens", str(NEW_TOKENS),
              "--json", "--dtype", "float32", "--ignore-eos", "--device", "cpu"])
    out, err = capsys.readouterr()
    assert exit_info.value.code == 0, err
    tokens = json.loads(out)["tokens"]
    assert len(tokens) == NEW_TOKENS and tokens == transformers_tokens(user_model, "cpu")


def test_the_made_model_has_a_chat_template(user_model):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(user_model)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert ids[0] == start and ids.count(start) == 2  # the markers are single special tokens


def test_the_step_runs_each_command_and_checks_what_it_printed(user_model, monkeypatch):
    """user_step's own logic, with each command run in this process (the campaign runs them as
    processes; the commands themselves are tested end to end elsewhere) and the server stubbed."""
    from click.testing import CliRunner

    from triforce.bench.campaign import user_step
    from triforce.cli.main import cli

    ran = []

    def in_process(name, args, stdin=None, timeout_s=60):
        ran.append(name)
        result = CliRunner().invoke(cli, args, input=stdin)
        return {"name": name, "command": " ".join(args), "rc": result.exit_code, "ok": result.exit_code == 0,
                "seconds": 0.0, "stdout_tail": result.stdout[-1500:], "stderr_tail": result.stderr[-1500:],
                "json": user_step.last_json(result.stdout)}

    monkeypatch.setattr(user_step, "run", in_process)
    monkeypatch.setattr(user_step, "make_model", lambda folder: folder)  # made once, by the fixture
    monkeypatch.setattr(user_step, "serve_once", lambda folder: {"name": "serve", "ok": True, "json": {}})
    report = user_step.user_step(user_model)
    assert ran == ["generate", "generate-sampled", "generate-float32", "chat"]
    assert report["ok"] and report["greedy_float32_equals_transformers"], report["steps"]
    assert report["default_dtype"] in ("float32", "bfloat16") and len(report["tokens"]) == NEW_TOKENS
