"""The campaign's peers, their parts a CPU can check without the peers themselves: llama.cpp's
deep rows extrapolated on the line through shallow ones, DeepSpeed's model folder and kit checks,
and the 2026 desktop's goals read from a report."""
import json

import click
import pytest

from triforce.bench.campaign.deepspeed_peer import installed_site, model_folder
from triforce.bench.campaign.llamacpp_peer import extrapolated
from triforce.bench.campaign.report import results_rows


def decode_row(depth, ms, kv="f16", placement="-ngl 99 -nkvo 1"):
    return {"kv": kv, "placement": placement, "test": "decode", "depth": depth, "tokens": 32,
            "tokens_per_s": round(1000 / ms, 2), "spread": 0.1, "ms_per_token": ms}


def test_deep_decode_rows_lie_on_the_line_through_the_measured_ones():
    rows = [decode_row(512, 10.0), decode_row(2048, 16.0), decode_row(512, 5.0, kv="q8_0")]
    deep = extrapolated(rows, [65536, 131072])
    # q8_0 has one depth: no line through it, no row
    assert [(r["kv"], r["depth"]) for r in deep] == [("f16", 65536), ("f16", 131072)]
    per_token = 6.0 / 1536
    assert deep[1]["ms_per_token"] == pytest.approx(10.0 + per_token * (131072 - 512), abs=1e-3)
    assert deep[1]["extrapolated_from"] == [512, 2048] and deep[1]["spread"] is None
    assert extrapolated([*rows, *deep], [4096])[0]["ms_per_token"] == pytest.approx(10.0 + per_token * 3584, abs=1e-3)


def test_deepspeed_gets_a_llama_config_of_the_named_shape(tmp_path):
    folder = model_folder("llama2-7b-128k", 16392, tmp_path / "m")
    config = json.loads((folder / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"], config["num_key_value_heads"]) == (4096, 32, 32)
    assert config["max_position_embeddings"] == 16392 and config["model_type"] == "llama"
    with pytest.raises(click.ClickException, match="for Llama"):
        model_folder("qwen3-8b-128k", 4096, tmp_path / "q")


def test_a_missing_deepspeed_kit_names_the_script_that_makes_it(tmp_path):
    with pytest.raises(click.ClickException, match="build_deepspeed_kit.sh"):
        installed_site(tmp_path / "no-kit", tmp_path / "site")


def step(name, result):
    return {"name": name, "what": "", "rc": 0, "ok": True, "seconds": 1.0, "estimate_s": 1, "result": result}


def report(*steps):
    return {"date": "2026-11-29", "cap_gb": 24, "environment": {"device": "test"}, "steps": list(steps)}


def test_the_desktop_goals_read_each_peer_beside_ours():
    small = {"context": 131072, "rows": [{"method": "triforce", "ms_per_token": 9.0}],
             "auto_choice": {"method": "triforce", "said": "method auto: triforce (predicted 2.45x of ar)"}}
    llama = {"model": "m.gguf", "rows": [decode_row(131072, 20.0, placement="-ngl 99"),
                                         {**decode_row(0, 1.0), "test": "prefill", "tokens": 131072, "seconds": 40.0}]}
    ttft = {"context": 131072, "ttft_s": 44.0, "arch": "llama3.1-8b", "dtype": "bfloat16", "weights": "q4_k",
            "profile": "rtx4090-24g-display", "prefill_s": 43.0, "prefill_tokens_per_s": 3048, "h2d_bytes": 0,
            "d2h_bytes": 0, "plan_gpu_bytes": 21 << 30, "prompt": "random tokens"}
    large = {"context": 131072, "rows": [{"method": "triforce", "ms_per_token": 140.0}]}
    host = {"model": "q.gguf", "rows": [{**decode_row(131072, 500.0), "extrapolated_from": [512, 2048]}]}
    ds = {"peer": "deepspeed-zero-inference", "kit": "deepspeed 0.19.8", "arch": "llama2-7b-128k", "kv_offload": True,
          "rows": [{"context": 4096, "prefill_s": 0.5, "ms_per_token": 300.0}],
          "failures": [{"context": 8192, "error": "out of memory: CUDA out of memory"}],
          "ours": [{"context": 4096, "rows": [{"method": "ar-offload", "ms_per_token": 25.0},
                                              {"method": "triforce", "ms_per_token": 20.0}]}]}
    lines = "\n".join(results_rows(report(step("desktop-decode-small", small), step("llamacpp-small", llama),
                                          step("desktop-prefill-small", ttft), step("desktop-decode-large", large),
                                          step("llamacpp-large", host), step("deepspeed", ds))))
    assert "| 8B Q4_K_M decode at 131072 | triforce 9.0 ms/token, llama.cpp (f16 KV) 20.0: 2.22x; auto runs " \
           "triforce | >= 2.0x llama.cpp | yes |" in lines
    assert "| 8B Q4_K_M time to first token at 131072 | 44.0 s against llama.cpp's prefill 40.0 s: 1.10x |" in lines
    assert "500.0 ms/token extrapolated: 3.57x | <= 150 ms/token and >= 3x llama.cpp | yes |" in lines
    assert "| against DeepSpeed ZeRO-Inference | ar-offload 12.00x at worst, triforce 15.00x at worst; DeepSpeed " \
           "failed at 8192 |" in lines and "| yes |" in lines.split("against DeepSpeed")[1].splitlines()[0]
    assert "| 4096 | 0.5 | 300.0 | 25.0 (12.0x) | 20.0 (15.0x) |" in lines
    assert "- DeepSpeed at 8192: out of memory: CUDA out of memory" in lines
    assert "| 500.0 (extrapolated from depths 512,2048) |" in lines


def test_a_desktop_goal_whose_steps_did_not_run_says_so():
    lines = "\n".join(results_rows(report(step("probe", {}))))
    assert "| 8B Q4_K_M decode at 131072 | not measured (desktop-decode-small or llamacpp-small gave no row) |  | - |" in lines
    assert "| against DeepSpeed ZeRO-Inference | not measured" in lines
