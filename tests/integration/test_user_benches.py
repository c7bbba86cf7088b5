"""The user benchmarks `triforce bench --help` lists, each run on a CPU at a small size through the
strings a user types, in each output form. (offload, batch, kernels and tiers run in their
own tests and in the reduced GPU campaign; llamacpp needs llama.cpp's binary: tests/unit/test_vs_llamacpp.py.)"""
import csv
import io
import json

import pytest

from triforce.cli.main import main
from triforce.kernels.cpu.attention import decode
from triforce.kernels.cpu.simd.amx import HAS_AMX


def run(capsys, *args) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main([str(a) for a in args])
    out, err = capsys.readouterr()
    assert exit_info.value.code == 0, err
    return out


def run_failing(capsys, *args) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main([str(a) for a in args])
    assert exit_info.value.code == 2
    return capsys.readouterr().err


def test_speed_by_context_same_tokens_for_each_method(capsys):
    report = json.loads(run(capsys, "bench", "context", "--contexts", "160", "--new-tokens", "6", "--repeats", "1",
                            "--methods", "ar,triforce", "--dtype", "float32", "--format", "json"))
    row, = report["rows"]
    assert row["context"] == 160 and row["ar_tok_s"] > 0 and row["triforce_vs_ar"] > 0 and row["same_tokens"]
    assert row["ar_spread"] == 0.0  # one repeat: no spread
    assert report["weights"] == "float" and report["provenance"]["cpu_flags"]


def test_speed_by_context_of_a_method_with_named_flags(capsys, monkeypatch):
    """`triforce:gamma1=2` keeps gamma1 as named (no controller adapts it), beside the plain
    method whose gamma1 the engine adapts; a flag that is not one stops before any prefill."""
    from triforce.bench import method_auto

    engines, real = [], method_auto.decode
    monkeypatch.setattr(method_auto, "decode", lambda *args: (lambda out: engines.append(out[2]) or out)(real(*args)))
    report = json.loads(run(capsys, "bench", "context", "--contexts", "160", "--new-tokens", "6", "--repeats", "1",
                            "--methods", "ar,triforce,triforce:gamma1=2", "--dtype", "float32", "--format", "json"))
    row, = report["rows"]
    assert row["triforce:gamma1=2_tok_s"] > 0 and row["triforce_tok_s"] > 0 and row["same_tokens"]
    _, adapting, named = engines
    assert adapting.policy.gamma1_controller is not None and adapting.spec.gamma1 == 4
    assert named.policy.gamma1_controller is None and named.spec.gamma1 == 2
    err = run_failing(capsys, "bench", "context", "--contexts", "160", "--methods", "ar,triforce:gamma=2")
    assert "'gamma=2' in 'triforce:gamma=2'" in err and "gamma1, gamma2, budget, chunk_size" in err
    assert not engines[3:]


def test_speed_by_context_sampled_as_chat_samples(capsys, monkeypatch):
    from triforce.bench import method_auto
    from triforce.config import CHAT_SAMPLING

    seen, real = [], method_auto.decode
    monkeypatch.setattr(method_auto, "decode", lambda *args: seen.append(args[-1]) or real(*args))
    for sampling, seed in (("chat", None), ("chat-seeded", 0)):  # as chat draws (unseeded), or repeatable
        seen.clear()
        report = json.loads(run(capsys, "bench", "context", "--contexts", "160", "--new-tokens", "6", "--repeats", "1",
                                "--methods", "ar,auto", "--dtype", "float32", "--sampling", sampling, "--format", "json"))
        row, = report["rows"]
        assert report["sampling"] == sampling and row["ar_tok_s"] > 0 and row["auto_vs_ar"] > 0
        assert "auto_vs_its_ar_steps" in row  # None: 6 tokens are too few ar steps to read a rate from
        assert [(s.temperature, s.top_p, s.repeat_penalty, s.seed) for s in seen] == \
            [(CHAT_SAMPLING.temperature, CHAT_SAMPLING.top_p, CHAT_SAMPLING.repeat_penalty, seed)] * 2


def test_auto_against_the_ar_steps_of_its_own_run():
    """At 26K a VM drifted 10% between two methods' runs, minutes apart: auto's own ar steps are
    its paired reference."""
    from triforce.bench.method_auto import MIN_AR_STEPS, against_its_ar_steps

    steps = [(False, 1, 0.010)] * MIN_AR_STEPS
    assert against_its_ar_steps(steps + [(True, 2, 0.030)]) == pytest.approx(10 * 0.010 / 0.110)
    assert against_its_ar_steps(steps + [(True, 4, 0.020)]) == pytest.approx(12 * 0.010 / 0.100)  # a winning round
    assert against_its_ar_steps(steps[1:] + [(True, 2, 0.030)]) is None  # too few steps to read a rate from
    assert against_its_ar_steps(steps + [(False, 0, 0.001)]) == pytest.approx(8 * 0.010 / 0.081)  # a stop: no step


def test_sampling_steps_loops_against_torch_s_operators(capsys):
    report = json.loads(run(capsys, "bench", "sampling", "--vocab", "500", "--context", "40", "--rows", "3",
                            "--repeats", "5", "--json"))
    assert [row["step"] for row in report["rows"]] == ["penalties", "probabilities", "seeded choice",
                                                       "seeded verify of 3 rows"]
    assert all(row["loop_us"] > 0 and row["torch_us"] > 0 and row["torch_over_loop"] > 0 for row in report["rows"])
    assert report["vocab"] == 500 and report["provenance"]["commit"]
    err = run_failing(capsys, "bench", "sampling", "--vocab", "64")
    assert "Invalid value for '--vocab'" in err  # no wider than the loops' candidates: nothing to compare


def test_against_transformers_as_csv(capsys):
    lines = list(csv.DictReader(io.StringIO(run(capsys, "bench", "transformers", "--contexts", "96", "--new-tokens",
                                                 "4", "--repeats", "1", "--format", "csv"))))
    assert len(lines) == 1 and lines[0]["prompt_tokens"] == "96" and lines[0]["same_tokens"] == "True"
    assert float(lines[0]["decode_speedup"]) > 0 and lines[0]["commit"]


def test_start_time_of_chat(capsys):
    report = json.loads(run(capsys, "bench", "start", "--no-cold", "--repeats", "1", "--dtype", "float32", "--json"))
    row, = report["rows"]
    assert row["start"] == "later" and 0 < row["to_prompt_s"] <= row["to_exit_s"] and row["repeats"] == 1


def test_the_server_benchmarks_as_tables(capsys):
    out = run(capsys, "bench", "serve-ttft", "--document-tokens", "200", "--max-context", "1024", "--new-tokens", "3",
              "--dtype", "float32", "--rows", "1")
    assert "| turn 2, cold |" in out and "sooner than the same request cold" in out
    report = json.loads(run(capsys, "bench", "serve-ttft", "--document-tokens", "200", "--max-context", "1024",
                            "--new-tokens", "3", "--dtype", "float32", "--prompt", "held-out", "--json"))
    assert report["server_rows"] == 4 and [r["request"] for r in report["rows"]] == ["turn 1", "turn 2"]
    assert report["rows"][1]["cached_tokens"] > 200 and report["rows"][0]["prefill_tok_s"] > 0
    out = run(capsys, "bench", "serve-load", "--clients", "2", "--prompt-tokens", "40", "--new-tokens", "3",
              "--max-context", "512", "--dtype", "float32")
    assert "| 2 together |" in out and "the throughput of one by one" in out


def test_bfloat16_agreement_is_reported_prompt_by_prompt(capsys):
    report = json.loads(run(capsys, "eval", "agreement", "--against", "bfloat16-speculation", "--prompts", "2",
                            "--prompt-tokens", "48", "--new-tokens", "6", "--methods", "triforce", "--json"))
    assert [r["prompt"] for r in report["rows"]] == [0, 1] and report["identical"]["triforce"].endswith("/2")
    assert all(r["identical"] == (r["parts_at"] is None) for r in report["rows"])


def test_agreement_with_llamacpp_needs_its_binary(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["eval", "agreement", "--against", "llamacpp"])
    assert exit_info.value.code != 0 and "--llama-completion" in capsys.readouterr().err


def test_a_prefill_of_a_model_split_into_attention_and_projections(capsys, tiny_model_dir):
    report = json.loads(run(capsys, "bench", "prefill", "--model", tiny_model_dir("llama-gqa"), "--context", "300",
                            "--new-tokens", "2", "--dtype", "float32", "--breakdown", "--json"))
    assert report["arch"] == "llama" and report["prompt"] == "random token ids"
    row, = report["rows"]
    assert row["prefill_s"] > 0 and row["attention_s"] > 0 and row["projections_s"] > 0
    assert row["attention_s"] + row["projections_s"] + row["other_ops_s"] <= 1.5 * row["prefill_s"]
    out = run(capsys, "bench", "prefill", "--model", tiny_model_dir("llama-gqa"), "--context", "40", "--new-tokens", "1",
              "--dtype", "float32", "--breakdown")
    assert "prefill by op (profiler self time): attention" in out


def _fake_llama_server(tmp_path, monkeypatch):
    """An executable that runs tests/fake_llama_server.py; its arguments land in the returned file."""
    import sys
    from pathlib import Path

    script = Path(__file__).parent.parent / "fake_llama_server.py"
    binary = tmp_path / "llama-server"
    binary.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{script}" "$@"\n')
    binary.chmod(0o755)
    monkeypatch.setenv("FAKE_LLAMA_ARGS", str(tmp_path / "args.json"))
    return binary, tmp_path / "args.json"


def test_a_conversation_through_llama_server_beside_ours(capsys, tmp_path, monkeypatch):
    """The same conversation (turn 1 and two follow-ups) through both servers, each turn's ratios
    side by side; llama-server gets our context, YaRN factor, threads, one slot and the file."""
    binary, args = _fake_llama_server(tmp_path, monkeypatch)
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    report = json.loads(run(capsys, "bench", "serve-ttft", "--document-tokens", "200", "--max-context", "16384",
                            "--rope-scaling", "yarn", "--new-tokens", "3", "--dtype", "float32", "--rows", "1",
                            "--follow-ups", "2", "--llama-server", binary, "--gguf", gguf, "--json"))
    turns = ["turn 1", "turn 2", "turn 3"]
    assert [(r["server"], r["request"]) for r in report["rows"]] == \
        [("triforce", t) for t in turns + ["turn 2, cold"]] + [("llama-server", t) for t in turns]
    peer = [r for r in report["rows"] if r["server"] == "llama-server"]
    assert peer[0]["cached_tokens"] == 0 and peer[1]["cached_tokens"] > 200 and peer[2]["cached_tokens"] > 200
    assert set(report["vs_llama_server"]) == set(turns)
    ours = {r["request"]: r for r in report["rows"] if r["server"] == "triforce"}
    for theirs in peer:  # each ratio is of the two rows beside it
        ratio = report["vs_llama_server"][theirs["request"]]
        assert ratio["ttft"] == round(theirs["ttft_s"] / ours[theirs["request"]]["ttft_s"], 2)
    given = json.loads(args.read_text())
    assert given[:10] == ["-m", str(gguf), "-c", "16384", "-np", "1", "-t", given[7], "-tb", given[7]]
    assert given[10:14] == ["--rope-scaling", "yarn", "--rope-scale", "2"]  # SmolLM2's 8192 stretched to 16384


def test_a_llama_server_that_fails_to_start_says_why(capsys, tmp_path, monkeypatch):
    binary, _ = _fake_llama_server(tmp_path, monkeypatch)
    flags = ["bench", "serve-ttft", "--document-tokens", "40", "--max-context", "512", "--new-tokens", "2",
             "--dtype", "float32", "--rows", "1", "--llama-server", binary]
    with pytest.raises(SystemExit) as exit_info:
        main([str(a) for a in flags + ["--gguf", tmp_path / "missing.gguf"]])
    err = capsys.readouterr().err
    assert exit_info.value.code == 1 and "llama-server exited with code 1" in err and "failed to load model" in err
    with pytest.raises(SystemExit) as exit_info:
        main([str(a) for a in flags[:-2] + ["--max-context", "16384", "--rope-scaling", "dynamic"] + flags[-2:]])
    assert exit_info.value.code == 2 and "llama-server has no --rope-scaling dynamic" in capsys.readouterr().err


def test_cpu_attention_against_sdpa_by_rows_on_the_default_models_heads(capsys):
    out = run(capsys, "bench", "attention", "--keys", "600", "--rows", "1,5", "--repeats", "3")
    assert "default: 9 heads, 3 KV heads, dim 64" in out and "| 600 | 5 |" in out
    report = json.loads(run(capsys, "bench", "attention", "--model", "none", "--heads", "4", "--kv-heads", "2",
                            "--keys", "300", "--rows", "1,17", "--dtype", "float32", "--repeats", "3", "--json"))
    one, wide = report["rows"]
    assert one["ours_ms"] > 0 and one["sdpa_ms"] > 0 and one["ours_over_sdpa"] > 0
    assert (one["routed"], wide["routed"]) == ("ours", "sdpa")  # beyond SMALL_QUERIES rows: SDPA
    assert report["provenance"]["cpu_flags"] and isinstance(report["amx_bf16"], bool)
    assert one["no_tiles_ms"] is None  # float32 never runs on AMX tiles: no second column


def test_a_bench_records_the_commit_it_started_at(capsys, monkeypatch):
    """A 26K row runs for minutes; results committed meanwhile labelled it with the later commit."""
    import triforce.bench.harness as harness

    commits = iter(["started-here", "committed-meanwhile"])
    monkeypatch.setattr(harness, "git_commit", lambda repo=None: next(commits))
    report = json.loads(run(capsys, "bench", "attention", "--model", "none", "--heads", "2", "--kv-heads", "1",
                            "--keys", "64", "--rows", "1", "--dtype", "float32", "--repeats", "3", "--json"))
    assert report["provenance"]["commit"] == "started-here"
    assert harness.provenance()["commit"] == "committed-meanwhile"  # outside a bench run: asked now


@pytest.mark.skipif(not HAS_AMX, reason="this CPU has no AMX")
def test_cpu_attention_times_the_tiles_beside_the_path_before_them(capsys):
    report = json.loads(run(capsys, "bench", "attention", "--keys", "600", "--rows", "5", "--repeats", "3", "--json"))
    (row,) = report["rows"]
    assert row["no_tiles_ms"] > 0 and row["ours_ms"] > 0
    assert decode.HAS_AMX  # put back after the timing


def test_cpu_attention_refuses_bad_lists_in_one_line(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "attention", "--rows", "1,x"])
    assert exit_info.value.code == 2 and "--rows must be comma-separated whole numbers" in capsys.readouterr().err
