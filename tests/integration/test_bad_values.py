"""Issue 14, class 5: values that used to end in a traceback are one `triforce: error:` line.
Each table row is one careless or hostile value; every row asserts the exit code, the single
error line and no traceback."""
import json
import shutil

import pytest

from test_cli import assert_one_line_error, run_cli

FLAG_CASES = [  # (flags after --model, a fragment of the error)
    (["--seed", str(2**70)], "--seed"),
    (["--budget", str(10**30), "--method", "retrieval"], "--budget"),
    (["--max-new-tokens", str(-2**40)], "--max-new-tokens"),
    (["--temperature", "inf"], "not a finite number"),
    (["--top-p", "nan"], "not a finite number"),
    (["--prompt", "caf\udce9"], "not valid UTF-8"),  # how Python keeps the byte 0xE9 of a Latin-1 argument
    (["--device", "mps"], "unknown device 'mps'"),
    (["--device", "meta"], "unknown device 'meta'"),
    (["--device", "xla"], "unknown device 'xla'"),
    (["--device", "cpu:3"], "unknown device"),
    (["--gamma2", "100000", "--method", "retrieval", "--max-new-tokens", "4"], "below the model's context"),
    (["--budget", "5000", "--method", "triforce", "--max-new-tokens", "4"], "below the model's context"),
]


@pytest.mark.parametrize("flags,fragment", FLAG_CASES)
def test_flag_values_are_one_error_line(capsys, tiny_model_dir, flags, fragment):
    model = str(tiny_model_dir("llama-gqa"))
    capsys.readouterr()
    prompt = [] if "--prompt" in flags else ["--prompt", "the cat"]
    code, _, err = run_cli(capsys, "generate", "--model", model, *prompt, *flags)
    assert_one_line_error(code, err, fragment)


def _edit_config(folder, edit):
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(edit(config)))


CONFIG_CASES = [  # (change to config.json, fragment)
    (lambda c: [c], "must hold a JSON object"),
    (lambda c: {**c, "num_attention_heads": 0}, "'num_attention_heads' must be a whole number"),
    (lambda c: {**c, "num_key_value_heads": 0}, "'num_key_value_heads' must be a whole number"),
    (lambda c: {**c, "hidden_size": "64"}, "'hidden_size' must be a whole number"),
    (lambda c: {**c, "vocab_size": 45.5}, "'vocab_size' must be a whole number"),
    (lambda c: {**c, "num_hidden_layers": 10**12}, "'num_hidden_layers' must be a whole number"),
    (lambda c: {**c, "head_dim": 7}, "must be even"),
    (lambda c: {**c, "num_key_value_heads": 3}, "not a multiple"),
    (lambda c: {**c, "rms_norm_eps": "x"}, "'rms_norm_eps' must be a positive number"),
    (lambda c: {**c, "eos_token_id": "x"}, "invalid"),
    (lambda c: {**c, "rope_parameters": {"rope_type": "yarn"}}, "invalid"),
    (lambda c: {k: v for k, v in c.items() if k != "vocab_size"}, "lacks 'vocab_size'"),
]


@pytest.mark.parametrize("case", range(len(CONFIG_CASES)))
def test_damaged_model_configs_are_one_error_line(capsys, tiny_model_dir, tmp_path, case):
    edit, fragment = CONFIG_CASES[case]
    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir("llama-gqa"), folder)
    _edit_config(folder, edit)
    capsys.readouterr()
    code, _, err = run_cli(capsys, "generate", "--model", str(folder), "--prompt", "the cat")
    assert_one_line_error(code, err, fragment)


TEMPLATE_CASES = [  # (chat_template, fragment)
    ('{{ raise_exception("no system role") }}', "(TemplateError): no system role"),
    ("{{ ().__class__.__base__.__subclasses__() }}", "(SecurityError)"),
    ("{% for m in messages %}{{ m.content | nosuchfilter }}{% endfor %}", "(TemplateAssertionError)"),
    ("{% for m in messages %}{{ m.content", "(TemplateSyntaxError)"),
    ("{{ messages[0].content + 1 }}", "chat template failed"),
    ("{% for i in range(99999) %}{% for j in range(99999) %}{{ i }}{% endfor %}{% endfor %}", "did not finish"),
]


@pytest.mark.parametrize("case", range(len(TEMPLATE_CASES)))
def test_chat_template_failures_are_one_error_line(capsys, tiny_model_dir, tmp_path, monkeypatch, case):
    template, fragment = TEMPLATE_CASES[case]
    monkeypatch.setattr("triforce.model.chat_template.RENDER_SECONDS", 0.5)  # the runaway loop's bound
    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir("llama-gqa"), folder)
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**tokenizer_config, "chat_template": template}))
    capsys.readouterr()
    code, _, err = run_cli(capsys, "generate", "--model", str(folder), "--prompt", "the cat", "--chat")
    assert_one_line_error(code, err, fragment)


PROFILE_CASES = [  # (a line replacing the field in the cpu profile, fragment)
    ("layer_overhead_us = nan", "must be a finite number"),
    ("hbm_gbps = inf", "must be a finite number"),
    ("gpu_bytes = nan", "must be a size from 0 to 1 EiB"),
    ("gpu_bytes = 1e300", "must be a size from 0 to 1 EiB"),
    ("host_bytes = 'lots'", "must be a size such as"),
    ("compute_tflops = 'fast'", "must be a number"),
    ("attention_tflops = 0", "field 'attention_tflops' must be a positive number"),
    ("cpu_threads = 1.5", "must be a whole number"),
    ("num_gpus = 99999", "must be from 0 to 64"),
    ("measured = 'yes'", "must be true or false"),
]


@pytest.mark.parametrize("line,fragment", PROFILE_CASES)
def test_profile_values_are_one_error_line(capsys, tmp_path, line, fragment):
    from importlib import resources

    key = line.split(" =")[0]
    shipped = resources.files("triforce.profiles").joinpath("cpu.toml").read_text()
    kept = [row for row in shipped.splitlines() if not row.startswith(key + " ")]
    path = tmp_path / "mine.toml"
    path.write_text("\n".join(kept + [line]) + "\n")
    code, _, err = run_cli(capsys, "plan", "--arch", "tiny-test", "--context", "64", "--profile", str(path))
    assert_one_line_error(code, err, fragment)


@pytest.mark.parametrize("method", ["retrieval", "triforce", "streaming", "snapkv", "naive"])
@pytest.mark.parametrize("prompt", ["t", "th"])
def test_the_shortest_prompts_run_every_method_as_ar_does(capsys, tiny_model_dir, method, prompt):
    """A one-token prompt leaves the full cache empty when the sparse tier is first built."""
    model = str(tiny_model_dir("llama-gqa"))
    capsys.readouterr()
    common = ["generate", "--model", model, "--prompt", prompt, "--max-new-tokens", "12", "--ignore-eos", "--json"]
    budget = "40" if method == "snapkv" else "32"  # snapkv's must exceed its 32-token window
    code, out, err = run_cli(capsys, *common, "--method", method, "--budget", budget, "--chunk-size", "4")
    assert code == 0, err
    code, ar_out, _ = run_cli(capsys, *common, "--method", "ar")
    assert json.loads(out)["tokens"] == json.loads(ar_out)["tokens"]


def test_chat_skips_a_line_that_is_not_utf8(capsys, tiny_model_dir, monkeypatch):
    lines = iter(["caf\udce9", "/stats"])

    def typed(prompt=""):
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None

    monkeypatch.setattr("builtins.input", typed)
    model = str(tiny_model_dir("llama-gqa"))
    capsys.readouterr()
    code, out, err = run_cli(capsys, "chat", "--model", model, "--max-new-tokens", "2")
    assert code == 0 and "Traceback" not in err
    assert "not valid UTF-8" in err and "turns                      0" in out


def test_a_snapkv_budget_within_its_window_is_one_error_line(capsys, tiny_model_dir):
    code, _, err = run_cli(capsys, "generate", "--model", str(tiny_model_dir("llama-gqa")), "--prompt", "the cat",
                           "--method", "snapkv", "--budget", "32", "--max-new-tokens", "2")
    assert_one_line_error(code, err, "observation window")
