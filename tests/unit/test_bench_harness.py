"""The benchmarks' one timing harness: warm-up calls are not timed, each_call times every call on
its own (median and spread), back_to_back_ms the mean of calls queued one after another."""
import time

import pytest
import torch

from triforce.bench.harness import Timing, back_to_back_ms, each_call


def test_each_call_times_every_call_after_the_warm_up():
    calls = []
    timing = each_call(lambda: calls.append(time.sleep(0.002 if len(calls) < 2 else 0.001)), torch.device("cpu"),
                       repeats=4, warmup=2)
    assert len(calls) == 6 and len(timing.samples_ms) == 4  # the two slower warm-up calls are not in it
    assert 1.0 <= timing.median_ms < 50 and timing.spread >= 0


def test_the_median_and_spread_of_samples():
    t = Timing((2.0, 4.0, 3.0))
    assert t.median_ms == 3.0 and t.spread == pytest.approx(2 / 3)


def test_back_to_back_is_the_mean_of_the_timed_calls():
    calls = []
    ms = back_to_back_ms(lambda: calls.append(time.sleep(0.001)), torch.device("cpu"), repeats=5, warmup=1)
    assert len(calls) == 6 and 1.0 <= ms < 50


def _printed(capsys, fmt, rows, table=None):
    from triforce.bench.harness import emit

    emit(fmt, {"model": "m"}, rows, table)
    return capsys.readouterr().out


def test_one_result_as_json_csv_and_a_table(capsys):
    import csv
    import io
    import json

    rows = [{"context": 512, "tok_s": 20.5, "tiers": {"full": 0.9}}, {"context": 2048, "tok_s": 18.25, "note": "x"}]
    report = json.loads(_printed(capsys, "json", rows))
    assert report["model"] == "m" and report["rows"] == rows and report["provenance"]["commit"]
    lines = list(csv.reader(io.StringIO(_printed(capsys, "csv", rows))))
    assert lines[0][:4] == ["context", "tok_s", "tiers", "note"] and lines[0][4:6] == ["commit", "date"]
    assert lines[1][:4] == ["512", "20.5", '{"full": 0.9}', ""] and lines[2][3] == "x" and len(lines) == 3
    table = _printed(capsys, "table", rows).splitlines()
    assert table[0] == "| context | tok_s | tiers | note |" and table[1] == "|---:|---:|---|---|"
    assert _printed(capsys, "table", rows, lambda: print("own table")) == "own table\n"


def test_json_is_the_short_form_of_format_json():
    import click
    from click.testing import CliRunner

    from triforce.bench.harness import output_option

    @click.command()
    @output_option
    def command(fmt):
        click.echo(fmt)

    runner = CliRunner()
    assert [runner.invoke(command, args).output.strip() for args in ([], ["--json"], ["--format", "csv"])] == \
        ["table", "json", "csv"]
    assert "Invalid value for '--format'" in runner.invoke(command, ["--format", "xml"]).output


def test_the_commit_is_the_installed_checkout_s_from_any_folder(tmp_path, monkeypatch):
    """The results of 2026-11-29's llama.cpp rows, run from /tmp, said 'no git checkout'."""
    import subprocess
    from pathlib import Path

    import triforce.bench.harness as harness

    checkout = Path(harness.__file__).resolve().parent
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=checkout, capture_output=True, text=True)
    if head.returncode:
        pytest.skip("triforce is installed from no git checkout here")
    monkeypatch.delenv("TRIFORCE_COMMIT", raising=False)
    monkeypatch.chdir(tmp_path)
    assert harness.git_commit().removesuffix("+changes") == head.stdout.strip()
    assert harness.provenance()["commit"] == harness.git_commit()
