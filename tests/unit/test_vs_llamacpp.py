"""The llama.cpp comparison's --long row runs in the dtype this CPU picks, and says so before any
timing when that dtype's GGUF is missing."""
import torch
from click.testing import CliRunner

from triforce.bench import vs_llamacpp
from triforce.model.loading import resolve_dtype


def test_long_without_the_auto_dtypes_gguf_is_a_usage_error():
    auto = str(resolve_dtype("auto", torch.device("cpu"))).removeprefix("torch.")
    other = "bfloat16" if auto == "float32" else "float32"
    flags = ["--llama-bench", "x", "--gguf", f"{other}=y.gguf", "--long", "32000"]
    result = CliRunner().invoke(vs_llamacpp.main, flags)
    assert result.exit_code == 2 and f"--long runs in {auto} on this CPU" in result.output


FAKE_LLAMA_BENCH = """#!{python}
import json, os, sys
import psutil
# the process that started this benchmark's neighbours: our bench's parent (llama-bench <- bench <- it)
starter = psutil.Process(os.getppid()).ppid()
spinning = sorted(p.nice() for p in psutil.Process(starter).children()
                  if p.cmdline()[-2:] == ["-c", "while True: pass"])
with open({log!r}, "a") as log:
    log.write(json.dumps(spinning) + "\\n")
calls = sum(1 for _ in open({log!r}))
print(json.dumps([{{"avg_ts": 10.0 * calls if {drifting} else 50.0}}]))  # drifting: faster call by call
"""


def _beside(tmp_path, tiny_model_dir, capsys, drifting: bool, *flags) -> tuple[list[dict], list[list[int]]]:
    """`triforce bench llamacpp --beside quiet,busy-nice19 FLAGS` on a fake llama-bench: the rows,
    and the nice levels of the neighbours spinning at each of its calls."""
    import json
    import sys

    import pytest

    from triforce.cli.main import main

    log = tmp_path / "neighbours.log"
    fake = tmp_path / "llama-bench"
    fake.write_text(FAKE_LLAMA_BENCH.format(python=sys.executable, log=str(log), drifting=drifting))
    fake.chmod(0o755)
    args = ["bench", "llamacpp", "--llama-bench", str(fake), "--gguf", f"float32={tmp_path / 'm.gguf'}",
            "--model", str(tiny_model_dir("llama-gqa")), "--depths", "24", "--new-tokens", "4", "--prefill", "0",
            "--repeats", "1", "--beside", "quiet,busy-nice19", *flags, "--json"]
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    out, err = capsys.readouterr()
    assert exit_info.value.code == 0, err
    return json.loads(out)["rows"], [json.loads(line) for line in log.read_text().splitlines()]


def test_beside_busy_neighbours_each_condition_runs_with_its_own(tmp_path, tiny_model_dir, capsys):
    """Issue 76: `--beside` measures both sides again beside busy neighbours (here one at nice 19),
    which spin while both run and are gone after; each row says beside what, and how it fared
    against its quiet twin."""
    import psutil

    (quiet, busy), spinning = _beside(tmp_path, tiny_model_dir, capsys, False)
    assert (quiet["beside"], busy["beside"]) == ("quiet", "busy-nice19") and quiet["file"] == "m.gguf"
    assert busy["llamacpp_vs_quiet"] == 1.0 and busy["triforce_vs_quiet"] > 0
    assert spinning == [[], [19]]
    assert not [p for p in psutil.Process().children() if p.cmdline()[-2:] == ["-c", "while True: pass"]]


def test_beside_refuses_what_it_cannot_run():
    result = CliRunner().invoke(vs_llamacpp.main, ["--llama-bench", "x", "--gguf", "float32=y", "--beside", "busy-nice30"])
    assert result.exit_code == 2 and "'busy-nice30': give quiet, busy, N-busy" in result.output


def test_rounds_rotate_the_conditions_and_keep_each_sides_best(tmp_path, tiny_model_dir, capsys):
    """Issue 76: `--rounds 2` runs quiet then nice 19, then nice 19 then quiet, and each row keeps
    llama.cpp's best of its two rounds (the drift no longer lands on one condition)."""
    (quiet, busy), spinning = _beside(tmp_path, tiny_model_dir, capsys, True, "--rounds", "2")
    assert spinning == [[], [19], [19], []]
    assert (quiet["beside"], busy["beside"]) == ("quiet", "busy-nice19")
    assert (quiet["llamacpp_tok_s"], busy["llamacpp_tok_s"]) == (40.0, 30.0) and quiet["rounds"] == busy["rounds"] == 2
    assert busy["llamacpp_vs_quiet"] == 0.75
    assert busy["ratio"] == round(busy["triforce_tok_s"] / 30.0, 3)


def test_rounds_without_conditions_to_cycle_is_a_usage_error():
    result = CliRunner().invoke(vs_llamacpp.main, ["--llama-bench", "x", "--gguf", "float32=y", "--rounds", "3"])
    assert result.exit_code == 2 and "--rounds cycles through --beside's conditions" in result.output


def test_a_gguf_row_runs_ours_on_its_own_file(tmp_path, tiny_model_dir, monkeypatch):
    """Issue 76: `--gguf gguf=FILE` times ours on FILE's blocks, whatever --model says (a row once
    ran ours on --model while llama.cpp read FILE): a FILE that is not there stops the row before
    any timing, though --model is a model ours could run."""
    monkeypatch.chdir(tmp_path)  # a short name: messages shorten long paths
    flags = ["--llama-bench", "x", "--gguf", "gguf=absent.gguf",
             "--model", str(tiny_model_dir("llama-gqa")), "--depths", "24", "--prefill", "0"]
    result = CliRunner().invoke(vs_llamacpp.main, flags)
    message = str(result.exception or "") + result.output
    assert result.exit_code != 0 and "'absent.gguf' does not exist" in message
