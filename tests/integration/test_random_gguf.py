"""Issue 72: random-weight GGUF files laid out as llama.cpp's Q4_K_M and Q8_0 of a named
architecture (bench/random_gguf.py). The plan matches a real Llama-3.1-8B Q4_K_M file's tensor
counts, the blocks de-quantize (by the gguf package, the reference reader) to finite weights of
about std 0.02, triforce generates from the file, and llama.cpp reads it where a build is at hand."""
import json
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from test_cli import run_cli
from triforce.bench.random_gguf import main, tensor_plan, use_more_bits, write_random_gguf
from triforce.model.architectures import ARCHITECTURES

# a Qwen3 block (q/k norms, head_dim apart from hidden / heads) in a file of a few MB
SMALL_QWEN3 = dict(model_type="qwen3", vocab_size=49152, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-6,
                   max_position_embeddings=4096, rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                                                  "rope_theta": 1e6,
                                                                  "original_max_position_embeddings": 1024})


def _kinds(plan):
    counts: dict = {}
    for p in plan:
        counts[p.kind] = counts.get(p.kind, 0) + 1
    return counts


def test_the_plan_is_llama_cpps_q4_k_m():
    """llama.cpp's Llama-3.1-8B-Instruct Q4_K_M lists 193 q4_K and 33 q6_K tensors (with 65 float32
    norms and its rope_freqs table, which is not written here)."""
    plan = tensor_plan(dict(ARCHITECTURES["llama3.1-8b"]), "q4_k_m")
    assert _kinds(plan) == {"q4_k": 193, "q6_k": 33, "f32": 65}
    kinds = {p.name: p.kind for p in plan}
    assert kinds["output.weight"] == "q6_k" and kinds["token_embd.weight"] == "q4_k"
    assert [i for i in range(32) if kinds[f"blk.{i}.attn_v.weight"] == "q6_k"] == \
        [i for i in range(32) if use_more_bits(i, 32)] == [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]
    tied = {p.name: p.kind for p in tensor_plan(dict(ARCHITECTURES["gemma3-27b"]), "q4_k_m")}
    assert "output.weight" not in tied and tied["token_embd.weight"] == "q6_k"  # the head's type, as llama.cpp
    assert set(_kinds(tensor_plan(dict(ARCHITECTURES["qwen3-32b-128k"]), "q8_0"))) == {"q8_0", "f32"}


@pytest.mark.parametrize("file_type", ["q4_k_m", "q8_0"])
def test_the_blocks_read_back_finite_at_the_planned_spread(tmp_path, file_type, default_model_dir):
    from gguf import GGUFReader
    from gguf.quants import dequantize

    path = tmp_path / "m.gguf"
    written = write_random_gguf(path, SMALL_QWEN3, file_type)
    reader = GGUFReader(str(path))
    plan = {p.name: p for p in tensor_plan(SMALL_QWEN3, file_type)}
    assert written["architecture"] == "qwen3" and {t.name for t in reader.tensors} == set(plan)
    for tensor in reader.tensors:
        assert tensor.tensor_type.name.lower() == plan[tensor.name].kind
        weights = dequantize(tensor.data, tensor.tensor_type)
        assert weights.shape == plan[tensor.name].shape and np.isfinite(weights).all()
        if plan[tensor.name].kind != "f32":
            assert 0.012 < float(weights.std()) < 0.03 and abs(float(weights.mean())) < 0.005
    assert reader.fields["qwen3.rope.scaling.type"].contents() == "yarn"
    assert len(reader.fields["tokenizer.ggml.tokens"].contents()) == 49152


@pytest.mark.parametrize("arch", ["llama-68m", "qwen3-tiny-test"])
def test_triforce_generates_from_the_file(capsys, tmp_path, default_model_dir, arch):
    """qwen3-tiny-test's heads are 64 wide: transformers' GGUF reader alone left Qwen3's 128."""
    result = CliRunner().invoke(main, [str(tmp_path / "l.gguf"), "--arch", arch, "--type", "q4_k_m"])
    assert result.exit_code == 0, result.output
    assert f"{arch} q4_k_m" in result.output
    code, out, err = run_cli(capsys, "generate", "--model", str(tmp_path / "l.gguf"), "--quantize", "gguf",
                             "--prompt", "hello world", "--max-new-tokens", "6", "--ignore-eos", "--json")
    assert code == 0, err
    report = json.loads(out)
    assert len(report["tokens"]) == 6 and "q4_k" in report["quantized"]["weights"]


def test_bad_arguments_are_one_line_errors(tmp_path, default_model_dir):
    runner = CliRunner()
    assert "unknown architecture 'nope'" in str(runner.invoke(main, [str(tmp_path / "x.gguf"), "--arch", "nope"]).exception)
    result = runner.invoke(main, [str(tmp_path / "x.gguf"), "--arch", "smollm2-135m"])
    assert result.exit_code != 0 and "576 weights are not whole q6_k blocks of 256" in result.output
    result = runner.invoke(main, [str(tmp_path / "x.gguf"), "--arch", "llama-68m", "--layers", "9"])
    assert result.exit_code != 0 and "must be 1 to 2" in result.output


def _llama_bench() -> Path | None:
    """A llama.cpp build's llama-bench: $LLAMA_BENCH, or the shared build script's default place."""
    for candidate in (os.environ.get("LLAMA_BENCH"), Path.home() / ".cache" / "llamacpp" / "bin" / "llama-bench",
                      shutil.which("llama-bench")):
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    return None


@pytest.mark.skipif(_llama_bench() is None, reason="no llama.cpp build here (bash ../shared/tools/build_llamacpp.sh)")
@pytest.mark.parametrize("fields", [dict(ARCHITECTURES["llama-68m"]), SMALL_QWEN3], ids=["llama", "qwen3"])
def test_llama_cpp_reads_the_same_file(tmp_path, fields, default_model_dir):
    path = tmp_path / "m.gguf"
    write_random_gguf(path, fields, "q4_k_m")
    run = subprocess.run([str(_llama_bench()), "-m", str(path), "-p", "16", "-n", "4", "-r", "1", "-t", "2", "-o", "json"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = json.loads(run.stdout)
    assert {row["n_gen"] for row in rows} >= {4} and all(row["avg_ts"] > 0 for row in rows)
