"""`generate --prompts` as a user meets it: texts in input order, the JSON shape the issue asks
for, each row's tokens those of its own run, and one-line errors."""
import json

import pytest

from test_cli import assert_one_line_error, run_cli


def write_prompts(tmp_path, *prompts, name="prompts.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    return str(path)


def test_json_holds_every_prompt_in_order_and_the_batch(capsys, tiny_model_dir, tmp_path):
    model = str(tiny_model_dir("llama-gqa"))
    texts = ["abc abc abc", "hello hello world", "one two one two", "zz yy zz"]
    code, out, _ = run_cli(capsys, "generate", "--model", model, "--prompts", write_prompts(tmp_path, *texts),
                           "--method", "snapkv", "--budget", "40", "--chunk-size", "4", "--max-new-tokens", "12",
                           "--batch-size", "3", "--json")
    assert code == 0
    report = json.loads(out)
    batch = report["batch"]
    assert batch["prompts"] == 4 and batch["batch_size"] == 3 and batch["method"] == "snapkv"
    assert batch["throughput_tok_s"] > 0 and batch["latency_ms_per_token"] > 0 and batch["rows_per_pass"] > 1
    assert set(batch["acceptance_rates"]) == {"full"}  # the full tier checks the snapkv drafts
    assert len(report["results"]) == 4
    for text, row in zip(texts, report["results"]):
        code, out, _ = run_cli(capsys, "generate", "--model", model, "--prompt", text, "--method", "ar",
                               "--max-new-tokens", "12", "--json")
        alone = json.loads(out)
        assert row["tokens"] == alone["tokens"] and row["text"] == alone["text"]
        assert row["prompt_tokens"] == alone["prompt_tokens"] and row["stopped_by"] == alone["stopped_by"]


def test_texts_print_in_input_order(capsys, tiny_model_dir, tmp_path):
    prompts = write_prompts(tmp_path, "abc", "hello world", "one")
    code, out, err = run_cli(capsys, "generate", "--model", str(tiny_model_dir("llama-gqa")), "--prompts", prompts,
                             "--max-new-tokens", "5", "--method", "ar")
    assert code == 0
    headers = [line for line in out.splitlines() if line.startswith("=== prompt")]
    assert [h.split()[2] for h in headers] == ["1", "2", "3"]
    assert "3 prompts" in err and "tok/s" in err and "ms per token per sequence" in err


@pytest.mark.parametrize("content,flags,fragment", [
    (None, ["--prompt", "x"], "give one of --prompt, --prompt-file and --prompts"),
    (None, ["--batch-size", "0"], "--batch-size must be >= 1"),
    (None, ["--record-acceptance", "a.json"], "--record-acceptance is for a single prompt"),
    ("", [], "holds no prompts"),
    ('{"prompt": "a"}\n{"prompt": 5}\n', [], "line 2 has no \"prompt\" string"),
    ('{"prompt": "a"}\n{oops\n', [], "line 2 is not JSON"),
    ('{"prompt": "' + "word " * 200 + '"}\n', [], "prompt 1 has"),
])
def test_bad_prompt_files_and_flags(capsys, tiny_model_dir, tmp_path, content, flags, fragment):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "abc"}\n' if content is None else content)
    code, _, err = run_cli(capsys, "generate", "--model", str(tiny_model_dir("llama-gqa")), "--prompts", str(path),
                           "--max-new-tokens", "4", *flags)
    assert_one_line_error(code, err, fragment)


def test_batch_size_needs_prompts_and_the_file_must_exist(capsys, tiny_model_dir, tmp_path):
    model = str(tiny_model_dir("llama-gqa"))
    code, _, err = run_cli(capsys, "generate", "--model", model, "--prompt", "x", "--batch-size", "2")
    assert_one_line_error(code, err, "--batch-size goes with --prompts")
    code, _, err = run_cli(capsys, "generate", "--model", model, "--prompts", str(tmp_path / "missing.jsonl"))
    assert_one_line_error(code, err, "does not exist")


def test_auto_picks_for_the_batch(capsys, tiny_model_dir, tmp_path):
    prompts = write_prompts(tmp_path, "abc abc abc", "hello hello")
    code, out, err = run_cli(capsys, "generate", "--model", str(tiny_model_dir("llama-gqa")), "--prompts", prompts,
                             "--max-new-tokens", "6", "--json")
    assert code == 0, err
    batch = json.loads(out)["batch"]
    choice = batch["method_choice"]
    assert choice is not None and choice["method"] == batch["method"]
    assert {p["rows"] for p in choice["predictions"]} == {2}


def test_bench_batch_measures_and_predicts(capsys, tiny_model_dir, tmp_path):
    model = str(tiny_model_dir("llama-gqa", max_position_embeddings=512))
    plot = tmp_path / "batch.png"
    code, out, err = run_cli(capsys, "bench", "batch", "--model", model, "--contexts", "64,96", "--batch-sizes", "2,1",
                             "--methods", "ar,streaming,snapkv", "--new-tokens", "4", "--budget", "40",
                             "--dtype", "float32", "--plot", str(plot), "--json")
    assert code == 0, err
    report = json.loads(out)
    rows = report["rows"]
    assert {(r["context"], r["batch_size"], r["method"]) for r in rows} == {
        (c, b, m) for c in (64, 96) for b in (1, 2) for m in ("ar", "streaming", "snapkv")}
    assert all(r["tokens_per_s"] > 0 and r["predicted_ms_per_token"] > 0 and "x_ar" in r for r in rows)
    assert set(report["crossover_batch_size"]) == {"64", "96"}
    assert {g["profile"] for g in report["gpu_predictions"]} == {"rtx4090-24g", "h100-80g"}
    assert plot.exists()
    assert {"commit", "date", "machine", "cpu_flags", "torch"} <= set(report["provenance"])  # what it ran on
    code, _, err = run_cli(capsys, "bench", "batch", "--model", model, "--methods", "streaming")
    assert_one_line_error(code, err, "--methods takes ar and any of")
    code, _, err = run_cli(capsys, "bench", "batch", "--model", model, "--batch-sizes", "1,x")
    assert_one_line_error(code, err, "--batch-sizes must be comma-separated integers")
    code, _, err = run_cli(capsys, "bench", "batch", "--model", model, "--contexts", "600")
    assert_one_line_error(code, err, "exceed the model's 512-token context")


def test_a_long_prompts_file_streams_in_bounded_memory(capsys, tiny_model_dir, tmp_path, monkeypatch):
    """Issue 45: prompts are tokenized for decoding only as rows free up, each result prints as
    soon as the ones before it have, and no finished result is held past its turn; the texts are
    still in input order and --json still one object."""
    import gc
    import weakref

    import triforce.app.completion as completion_module
    from triforce.app import batch_generate, generate_prompts

    model = str(tiny_model_dir("llama-gqa"))
    count, rows = 16, 2  # 8x the rows in flight; each result runs a gc.collect (40 took 29 s)
    path = write_prompts(tmp_path, *[f"prompt number {i} says {'ab ' * (i % 5)}" for i in range(count)])
    encoded, shown, held = [0], [], []
    real_encode, real_show, real_add = completion_module.encode_prompt, generate_prompts._InOrder._show, \
        generate_prompts._InOrder.add

    def counting_encode(*args, **kw):
        encoded[0] += 1
        return real_encode(*args, **kw)

    def recording_show(self, row, bar):
        shown.append(encoded[0])  # prompts encoded so far when this result printed
        real_show(self, row, bar)

    refs = []

    class TrackedRow(batch_generate.BatchRow):  # every result row, seen through weak references
        def __init__(self, *args, **kw):
            super().__init__(*args, **kw)
            refs.append(weakref.ref(self))

    def recording_add(self, row, bar):
        real_add(self, row, bar)
        del row
        gc.collect()
        held.append(sum(r() is not None for r in refs))  # result rows still alive anywhere

    monkeypatch.setattr(batch_generate, "BatchRow", TrackedRow)

    monkeypatch.setattr(completion_module, "encode_prompt", counting_encode)
    monkeypatch.setattr(generate_prompts._InOrder, "_show", recording_show)
    monkeypatch.setattr(generate_prompts._InOrder, "add", recording_add)
    code, out, _ = run_cli(capsys, "generate", "--model", model, "--prompts", path, "--max-new-tokens", "3",
                           "--method", "ar", "--batch-size", str(rows))
    assert code == 0
    headers = [line.split()[2] for line in out.splitlines() if line.startswith("=== prompt")]
    assert headers == [str(i) for i in range(1, count + 1)]
    # the lengths pass encodes every prompt once; decoding then encodes each as its row starts
    assert shown[0] <= count + rows + 1 and encoded[0] == 2 * count
    assert len(refs) == count and max(held) <= 2 * rows  # the rows in flight, not every result so far
    monkeypatch.undo()  # the JSON run needs no counting (nor a gc.collect per result)
    code, out, _ = run_cli(capsys, "generate", "--model", model, "--prompts", path, "--max-new-tokens", "3",
                           "--method", "ar", "--batch-size", str(rows), "--json")
    report = json.loads(out)
    assert len(report["results"]) == count and report["batch"]["prompts"] == count
