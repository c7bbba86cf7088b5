"""The natural-text corpus that benchmarks, traces and needle prompts read, and the per-tier
acceptance table measured on it."""
import json

import pytest

from triforce.app.evaluation import NEEDLE_FILLER, needle_prompt
from triforce.app.texts import natural_ids, natural_size, prompt_text, repeated_ids
from triforce.errors import UserError

from test_cli import run_cli

SPAN = 64


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    from triforce.model.loading import load_tokenizer
    return load_tokenizer(default_model_dir)


def repeated_span(ids: list[int], span: int = SPAN) -> int | None:
    """The start of the first `span`-token window that occurred earlier, or None."""
    seen: dict[int, int] = {}
    for i in range(len(ids) - span + 1):
        window = tuple(ids[i:i + span])
        key = hash(window)
        if key in seen and tuple(ids[seen[key]:seen[key] + span]) == window:
            return i
        seen.setdefault(key, i)
    return None


def test_the_corpus_fills_128k_without_repeating_a_64_token_span(tokenizer):
    ids = natural_ids(tokenizer, natural_size(tokenizer))
    assert len(ids) >= 131072 + 8192  # a 128K context, and room for the continuation
    assert repeated_span(ids) is None


def test_the_repeated_text_does_repeat_and_the_natural_text_refuses_past_its_end(tokenizer):
    assert repeated_span(repeated_ids(tokenizer, 60000)) is not None  # the best case, named so
    with pytest.raises(UserError, match="natural-text corpus holds"):
        natural_ids(tokenizer, natural_size(tokenizer) + 1)
    rows = [natural_ids(tokenizer, 1000, offset) for offset in (0, 1000)]
    assert rows[0] != rows[1] and len(prompt_text("natural", tokenizer, 1000)) > 3000


def test_the_held_out_text_is_in_no_shipped_file_and_refuses_past_its_end(tokenizer):
    """auto's check on text it has not seen: no 64-token span of it is in the shipped corpus."""
    held_out = tokenizer(prompt_text("held-out", tokenizer, 20000), add_special_tokens=False).input_ids
    corpus = natural_ids(tokenizer, natural_size(tokenizer))
    spans = {tuple(corpus[i:i + 64]) for i in range(0, len(corpus) - 64)}
    assert len(held_out) > 19000 and not any(tuple(held_out[i:i + 64]) in spans for i in range(0, len(held_out) - 64))
    with pytest.raises(UserError, match="held-out text holds"):
        prompt_text("held-out", tokenizer, 10 ** 6)


def test_a_needle_in_natural_text(tokenizer):
    prompt = needle_prompt(tokenizer, 3000, depth=0.5, seed=2)
    assert abs(prompt.tokens - 3000) < 60 and NEEDLE_FILLER.split(".")[0] not in prompt.text
    assert 0.45 < prompt.text.index(prompt.key) / len(prompt.text) < 0.55
    old = needle_prompt(tokenizer, 3000, depth=0.5, seed=2, haystack="repeated")
    assert old.key == prompt.key and NEEDLE_FILLER in old.text


def test_eval_acceptance_reports_each_tier(capsys, tiny_model_dir, tmp_path):
    prompt = tmp_path / "p.txt"
    prompt.write_text("the cat sat on the mat. the dog sat on the log. " * 2)
    code, out, err = run_cli(capsys, "eval", "acceptance", "--model", str(tiny_model_dir("llama-gqa")),
                             "--prompt-file", str(prompt), "--budgets", "32", "--chunk-size", "4", "--gen", "12",
                             "--drafts", "lookup,none", "--temperatures", "0,0.6", "--dtype", "float32", "--json")
    assert code == 0, err
    rows = json.loads(out)["tiers"]
    assert [(r["draft"], r["temperature"]) for r in rows] == [("lookup", 0), ("lookup", 0.6), ("none", 0),
                                                              ("none", 0.6)]
    for r in rows:
        assert r["new_tokens"] == 12 and 0 <= r["acceptance_rates"]["full"] <= 1
        assert r["per_token_rates"]["full"] >= r["acceptance_rates"]["full"] - 1e-9  # a rate is at least the kept share
    assert rows[0]["tiers"] == "lookup -> retrieval -> full" and rows[2]["tiers"] == "retrieval -> full"
    # `profile tune --acceptance` keeps these rows, and auto predicts with the lookup ones
    from triforce.cli.profile_cmd import _acceptance_rows
    from triforce.plan.speculation_choice import measured_tier_acceptance

    saved = tmp_path / "tiers.json"
    saved.write_text(out)
    kept = _acceptance_rows(str(saved))
    assert [r["draft"] for r in kept] == ["lookup", "lookup", "none", "none"]
    assert measured_tier_acceptance(kept).full == min(r["per_token_rates"]["full"] for r in rows[:2])


def test_eval_acceptance_refuses_bad_temperatures(capsys, tiny_model_dir, tmp_path):
    prompt = tmp_path / "p.txt"
    prompt.write_text("abc " * 10)
    code, _, err = run_cli(capsys, "eval", "acceptance", "--model", str(tiny_model_dir("llama-gqa")),
                           "--prompt-file", str(prompt), "--budgets", "32", "--chunk-size", "4", "--drafts", "lookup",
                           "--temperatures", "0,hot")
    assert code == 1 and "--temperatures must be numbers" in err and "Traceback" not in err
