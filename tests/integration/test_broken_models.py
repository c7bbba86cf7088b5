"""Broken numbers and absurd files end in one line: NaN or infinity in a folder's weights, in a
GGUF's block scales (on the blocks' path and when de-quantized to floats), and metadata claiming
more layers than the weights hold (refused at once, before a model that size is made)."""
import json
import shutil
import time

import numpy as np
import pytest
from safetensors.torch import load_file, save_file

from gguf_files import copy_gguf
from test_cli import assert_one_line_error, run_cli


def _generate(capsys, model, *extra):
    """(exit code, the error line): a first start of a GGUF names its steps on stderr before it."""
    capsys.readouterr()  # what making the fixtures printed
    code, _, err = run_cli(capsys, "generate", "--model", str(model), "--prompt", "hi", "--max-new-tokens", "2", *extra)
    assert "Traceback" not in err
    return code, err.strip().splitlines()[-1] + "\n"


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_folder_whose_weights_hold_nan_or_inf_is_one_line(capsys, tiny_model_dir, tmp_path, value):
    folder = tmp_path / "broken"
    shutil.copytree(tiny_model_dir("llama-gqa"), folder)
    state = load_file(str(folder / "model.safetensors"))
    state["model.layers.1.mlp.down_proj.weight"][3, 5] = value
    save_file(state, str(folder / "model.safetensors"))
    code, err = _generate(capsys, folder)
    assert_one_line_error(code, err, "tensor 'model.layers.1.mlp.down_proj.weight'", "1 NaN or infinite value(s)")


def _nan_scale(raw: np.ndarray) -> np.ndarray:
    """A Q4_1 tensor's first block with a NaN float16 scale."""
    raw = raw.copy()
    raw.reshape(-1)[:2] = np.array([np.float16("nan")]).view(np.uint8)
    return raw


def test_a_gguf_with_nan_block_scales_is_one_line_on_both_paths(capsys, tmp_path, monkeypatch, default_model_dir):
    from triforce.model.default_model import ensure_gguf

    broken = copy_gguf(ensure_gguf(), tmp_path / "nan.gguf", edit={"blk.2.ffn_up.weight": _nan_scale})
    monkeypatch.setenv("TRIFORCE_CACHE", str(tmp_path / "cache"))
    code, err = _generate(capsys, broken, "--quantize", "gguf")  # the file's blocks
    assert_one_line_error(code, err, "tensor 'blk.2.ffn_up.weight' in nan.gguf has NaN or infinite block scales")
    code, err = _generate(capsys, broken, "--quantize", "none")  # de-quantized to floats
    assert_one_line_error(code, err, "tensor 'model.layers.2.mlp.up_proj.weight'", "NaN or infinite value(s)")


def test_metadata_claiming_a_million_layers_is_refused_at_once(capsys, tmp_path, monkeypatch, tiny_model_dir,
                                                               default_model_dir):
    from triforce.model.default_model import ensure_gguf

    absurd = copy_gguf(ensure_gguf(), tmp_path / "absurd.gguf", fields={"llama.block_count": 1_000_000})
    monkeypatch.setenv("TRIFORCE_CACHE", str(tmp_path / "cache"))
    started = time.perf_counter()
    code, err = _generate(capsys, absurd)
    assert_one_line_error(code, err, "claims 1,000,000 layers but holds only 272 tensors")
    folder = tmp_path / "absurd-folder"
    shutil.copytree(tiny_model_dir("llama-mha"), folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1_000_000}))
    code, err = _generate(capsys, folder)
    assert_one_line_error(code, err, "claims 1,000,000 layers but its weights hold")
    assert time.perf_counter() - started < 20  # the 1,000,000-layer GGUF alone took 30 s


@pytest.mark.parametrize("method, temperature", [("ar", "0"), ("triforce", "0"), ("ar", "0.8"), ("triforce", "0.8")])
def test_logits_that_turn_nan_while_decoding_end_in_one_line_naming_the_layer(capsys, tiny_model_dir,
                                                                              overflowing_layer, method, temperature):
    code, err = _generate(capsys, tiny_model_dir("llama-gqa"), "--method", method, "--temperature", temperature,
                          "--draft", "lookup" if method == "triforce" else "none")
    assert_one_line_error(code, err, "the model's logits became NaN or infinite at token",
                          "first in model.layers.1", "try --dtype float32")


def test_the_server_answers_that_request_with_the_error_and_stays_up(default_model_dir, overflowing_layer):
    import openai

    from serve_helpers import LiveServer

    server = LiveServer(str(default_model_dir), max_context=256, batch_size=1)
    try:
        client = server.client()
        ask = dict(model="default", messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0)
        with pytest.raises(openai.APIError) as failed:
            client.chat.completions.create(**ask)
        assert "logits became NaN or infinite" in str(failed.value) and "model.layers.1" in str(failed.value)
        overflowing_layer["off"]()
        assert client.chat.completions.create(**ask).choices[0].message.content
    finally:
        server.stop()


def test_a_chat_turn_that_turns_nan_is_dropped_and_the_next_one_answers(tiny_model_dir, overflowing_layer):
    from triforce import LLM, SamplingParams, UserError

    llm = LLM(str(tiny_model_dir("llama-gqa")), dtype="float32", device="cpu", method="ar")
    conversation = llm.conversation()
    params = SamplingParams(max_tokens=4)
    with pytest.raises(UserError, match="first in model.layers.1"):
        conversation.send("the cat sat", params)
    overflowing_layer["off"]()
    assert conversation.send("the dog sat", params).token_ids
    assert [m["content"] for m in conversation.messages if m["role"] == "user"] == ["the dog sat"]


def test_nan_in_a_fused_phi3_projection_names_the_files_tensor(capsys, tiny_model_dir, tmp_path):
    folder = tmp_path / "broken-phi3"
    shutil.copytree(tiny_model_dir("phi3"), folder)
    state = load_file(str(folder / "model.safetensors"))
    state["model.layers.0.self_attn.qkv_proj.weight"][70, 1] = float("nan")  # a row of k
    save_file(state, str(folder / "model.safetensors"))
    code, err = _generate(capsys, folder)
    assert_one_line_error(code, err, "tensor 'model.layers.0.self_attn.qkv_proj.weight'", "1 NaN or infinite value(s)")


def test_a_phi3_config_that_does_not_match_its_fused_rows_is_one_line(capsys, tiny_model_dir, tmp_path):
    folder = tmp_path / "wrong-heads"
    shutil.copytree(tiny_model_dir("phi3"), folder)
    config = json.loads((folder / "config.json").read_text())
    config["num_key_value_heads"] = 4  # the file's qkv rows were made for 2
    (folder / "config.json").write_text(json.dumps(config))
    code, err = _generate(capsys, folder)
    assert_one_line_error(code, err, "model.layers.0.self_attn.qkv_proj.weight", "has 128 rows; the config implies 192 (q_proj, k_proj, v_proj)")
