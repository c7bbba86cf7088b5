"""Evaluation commands on the real default model (the long-prompt acceptance check, a needle in
5K tokens, runs with offloading in test_offload_cli)."""
import json

import pytest

from triforce.app.evaluation import evaluate_acceptance, needle_prompt
from triforce.cli.main import main


def run_cli(capsys, *args):
    with pytest.raises(SystemExit) as exit_info:
        main(list(args))
    out, err = capsys.readouterr()
    return exit_info.value.code, out, err


def test_needle_prompt_hides_the_key_at_the_depth(default_lm):
    prompt = needle_prompt(default_lm.tokenizer, 2000, depth=0.25, seed=3)
    assert abs(prompt.tokens - 2000) < 60
    position = prompt.text.index(prompt.key) / len(prompt.text)
    assert 0.2 < position < 0.3 and prompt.text.endswith("The pass key is")


def test_acceptance_figures_are_sane_and_retrieval_beats_streaming_on_a_needle(default_lm):
    prompt = needle_prompt(default_lm.tokenizer, 1500, depth=0.3, seed=1)
    ids = default_lm.tokenizer(prompt.text).input_ids
    results = evaluate_acceptance(default_lm, ids, [64, 256], ["streaming", "retrieval", "topk", "snapkv"], gen=8)
    assert len(results) == 8
    by = {(r["policy"], r["budget"]): r for r in results}
    for r in results:
        assert 0 <= r["greedy_match"] <= 1 and 0 < r["expected_accept"] <= 1 + 1e-6
    # the key sits far outside a 64-token streaming window: retrieval must find it, streaming cannot
    assert by[("retrieval", 256)]["greedy_match"] > by[("streaming", 64)]["greedy_match"]
    # SnapKV keeps what the question's tokens attend to: better drafts than StreamingLLM's (MagicDec)
    assert by[("snapkv", 256)]["expected_accept"] > by[("streaming", 256)]["expected_accept"]


def test_acceptance_command_json(capsys, tiny_model_dir, tmp_path):
    prompt = tmp_path / "p.txt"
    prompt.write_text("abc def ghi " * 8)
    code, out, _ = run_cli(capsys, "eval", "acceptance", "--model", str(tiny_model_dir("llama-gqa")),
                           "--prompt-file", str(prompt), "--budgets", "20,40", "--policies", "streaming,retrieval",
                           "--gen", "6", "--chunk-size", "4", "--sink-tokens", "4", "--json")
    assert code == 0
    results = json.loads(out)["results"]
    assert {(r["policy"], r["budget"]) for r in results} == {("streaming", 20), ("streaming", 40),
                                                              ("retrieval", 20), ("retrieval", 40)}
    assert all(set(r) == {"policy", "budget", "chunk_size", "greedy_match", "expected_accept"} for r in results)
    prompt.write_text("abc def ghi " * 9)  # 108 tokens, longer than the budget: SnapKV selects
    code, out, _ = run_cli(capsys, "eval", "acceptance", "--model", str(tiny_model_dir("llama-gqa")),
                           "--prompt-file", str(prompt), "--budgets", "40", "--policies", "snapkv", "--gen", "4",
                           "--json")
    assert code == 0 and [r["policy"] for r in json.loads(out)["results"]] == ["snapkv"]


@pytest.mark.parametrize("args,fragment", [
    (["--budgets", "abc"], "--budgets"), (["--policies", "magic"], "magic"), (["--gen", "0"], "--gen"),
    (["--policies", "snapkv", "--budgets", "32"], "observation window")])
def test_acceptance_bad_flags(capsys, tiny_model_dir, tmp_path, args, fragment):
    prompt = tmp_path / "p.txt"
    prompt.write_text("abc def")
    code, _, err = run_cli(capsys, "eval", "acceptance", "--model", str(tiny_model_dir("llama-gqa")),
                           "--prompt-file", str(prompt), *args)
    assert code != 0 and fragment in err and len(err.strip().splitlines()) == 1


def test_eval_loops_counts_answers_that_end_by_themselves(capsys):
    code, out, err = run_cli(capsys, "eval", "loops", "--samples", "2", "--repeat-penalties", "1.1",
                             "--max-new-tokens", "6", "--dtype", "float32")
    assert code == 0, err
    line = json.loads(out)
    assert line["repeat_penalty"] == 1.1 and line["samples"] == 2 and len(line["lengths"]) == 2
    assert 0 <= line["ended_by_themselves"] <= 2 and all(n <= 6 for n in line["lengths"])
    code, _, err = run_cli(capsys, "eval", "loops", "--repeat-penalties", "1.1,x")
    assert code != 0 and "--repeat-penalties takes numbers" in err


def test_chat_defaults_to_a_repeat_penalty(capsys):
    code, out, _ = run_cli(capsys, "chat", "--help")
    text = " ".join(out.split())  # the model's own defaults first (issue 75), chat's 1.1 where it sets none
    assert code == 0 and "--repeat-penalty" in out and "else triforce's chat default (1.1)" in text


def test_needle_ask_gives_a_verdict(capsys, tmp_path):
    code, out, err = run_cli(capsys, "eval", "needle", "--context", "300", "--depth", "0.1", "--out",
                             str(tmp_path / "n.txt"), "--ask")
    assert code == 0, err
    report = json.loads(out)
    assert report["found"] == (report["key"] in report["answer"]) and report["method"]
    assert f"the key {report['key']} at depth 0.1" in err and ("NOT found" in err) != report["found"]
