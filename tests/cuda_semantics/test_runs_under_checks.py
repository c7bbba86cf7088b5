"""Whole runs from the command line under the checks CUDA would enforce: every factory and random
draw names its device (generate with each method, greedy and sampled, a draft model, offloaded
KV, bench offload), and an offloaded generate runs its copies under the checked streams fake with
the resident run's tokens."""
import json

import pytest

from device_discipline import DeviceDiscipline, DeviceDisciplineError
from triforce.cli.main import main

PROMPT = "the cat sat on the mat. the cat sat on the hat. the cat and the dog sat on the log. the cat sat on"
LONG = PROMPT * 4  # 392 tokens: at --device-budget 1.9MB, 256 stay resident and the rest go to the host
TRACE = "bench/traces/smollm2-needle8k-repeated-filler-triforce-lookup.json"


def run(capsys, *args):
    with pytest.raises(SystemExit) as exit_info:
        main([str(a) for a in args])
    out, err = capsys.readouterr()
    assert exit_info.value.code == 0, err
    return out


@pytest.fixture(scope="module")
def models(tiny_model_dir):
    return (tiny_model_dir("llama-gqa", max_position_embeddings=512),
            tiny_model_dir("llama-gqa", seed=7, num_layers=1, hidden_size=32))


def generate(capsys, model, *extra, prompt=PROMPT):
    out = run(capsys, "generate", "--model", model, "--prompt", prompt, "--max-new-tokens", 12, "--budget", 48,
              "--chunk-size", 4, "--json", *extra)
    return json.loads(out)


@pytest.mark.parametrize("method", ["ar", "triforce", "retrieval", "streaming", "snapkv", "naive"])
@pytest.mark.parametrize("temperature", ["0", "0.7"])
def test_generate_names_every_device(capsys, models, method, temperature):
    target, draft = models
    draft_args = ["--draft", draft] if method == "triforce" else []
    with DeviceDiscipline() as mode:
        generate(capsys, target, "--method", method, "--temperature", temperature, "--seed", 1, *draft_args)
    assert mode.checked > 0


@pytest.mark.parametrize("method,extra", [("snapkv", []), ("triforce", ["--temperature", "0.7", "--seed", 1]),
                                          ("triforce", ["--device-budget", "3.8MB"])])  # each row offloaded
def test_a_batch_names_every_device(capsys, models, tmp_path, method, extra):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in (LONG, PROMPT, PROMPT[:30])))
    draft_args = ["--draft", models[1]] if method == "triforce" else []
    with DeviceDiscipline() as mode:
        out = run(capsys, "generate", "--model", models[0], "--prompts", prompts, "--max-new-tokens", 12,
                  "--budget", 48, "--chunk-size", 4, "--method", method, "--batch-size", 2, "--ignore-eos", "--json",
                  *draft_args, *extra)
    report = json.loads(out)
    assert mode.checked > 0 and [r["new_tokens"] for r in report["results"]] == [12, 12, 12]
    if "--device-budget" in extra:
        assert report["batch"]["plan"]["offloaded"]


def test_offloaded_generate_and_bench_name_every_device(capsys, models, tmp_path):
    with DeviceDiscipline():
        result = generate(capsys, models[0], "--method", "triforce", "--device-budget", "1.9MB", prompt=LONG)
        assert result["plan"]["offloaded"]
        run(capsys, "bench", "offload", "--arch", "llama-68m", "--context", 300, "--draft", "lookup",
            "--device-budget", "300MB", "--acceptance-trace", TRACE, "--new-tokens", 4, "--budget", 64,
            "--plot", tmp_path / "plot.png", "--json")


def test_planted_bug_a_draw_without_device_is_caught(capsys, models, monkeypatch):
    """The sampled verifier as it was: its uniform drawn without naming the generator's device
    (unseeded: a seeded request draws by its position's noise, decoding.sampling.PositionNoise)."""
    from triforce.decoding import verification as speculative

    source = open(speculative.__file__).read()
    assert ", device=generator.device)" in source
    planted: dict = {}
    exec(compile(source.replace(", device=generator.device)", ")"), speculative.__file__, "exec"), planted)
    monkeypatch.setattr(speculative, "verify_sampled", planted["verify_sampled"])
    with pytest.raises(DeviceDisciplineError, match="torch.rand without device="):
        with DeviceDiscipline():
            generate(capsys, models[0], "--method", "retrieval", "--temperature", "0.7")


def test_offloaded_generate_under_checked_streams(capsys, models, checked):
    resident = generate(capsys, models[0], "--method", "triforce", "--temperature", "0", prompt=LONG)
    offloaded = generate(capsys, models[0], "--method", "triforce", "--temperature", "0", "--device-budget", "1.9MB",
                         prompt=LONG)
    assert offloaded["plan"]["offloaded"] and offloaded["tokens"] == resident["tokens"]
    assert checked.copies > 0 and checked.checked_accesses > 0


def test_an_offloaded_batch_under_checked_streams(capsys, models, checked, tmp_path):
    """Two rows, each with its own offloaded cache and prefetcher, interleaved pass by pass: every
    copy keeps stream order, and each row's tokens are its resident single run's."""
    prompts = tmp_path / "prompts.jsonl"
    texts = (LONG, LONG[40:] + " the cat")
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in texts))
    out = run(capsys, "generate", "--model", models[0], "--prompts", prompts, "--max-new-tokens", 12, "--budget", 48,
              "--chunk-size", 4, "--method", "triforce", "--temperature", "0", "--device-budget", "3.8MB", "--json")
    report = json.loads(out)
    assert report["batch"]["plan"]["offloaded"] and report["batch"]["rows_per_pass"] > 1
    for text, row in zip(texts, report["results"]):
        assert row["tokens"] == generate(capsys, models[0], "--method", "triforce", "--temperature", "0",
                                         prompt=text)["tokens"]
    assert checked.copies > 0 and checked.checked_accesses > 0
