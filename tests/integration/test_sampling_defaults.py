"""Issue 75: one source of sampling defaults. A model's generation_config.json (a GGUF file's
general.sampling.* once converted) sets what `triforce chat`, the Python API (a call without
sampling parameters) and the server (a request's absent fields) sample with, printed at start;
a model that sets none gets triforce's chat defaults. `generate` stays greedy unless asked."""
import json
import os
import shutil
import sys

import pytest

from gguf_files import copy_gguf

PROMPT = "The capital of France is"
QWEN_LIKE = {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20, "bos_token_id": 1}


@pytest.fixture(scope="module")
def planted(tiny_model_dir, tmp_path_factory):
    """A tiny model whose generation_config.json recommends Qwen3's sampling."""
    folder = tmp_path_factory.mktemp("planted") / "model"
    shutil.copytree(tiny_model_dir("llama-gqa", max_position_embeddings=512), folder)
    (folder / "generation_config.json").write_text(json.dumps(QWEN_LIKE))
    return folder


def _llm(folder):
    from triforce import LLM
    return LLM(str(folder), method="ar", dtype="float32", device="cpu")


def test_the_api_samples_with_the_models_defaults_unless_told(planted):
    from triforce import SamplingParams

    llm = _llm(planted)
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_p, defaults.top_k, defaults.repeat_penalty) == (0.6, 0.95, 20, 1.0)
    assert llm.sampling_source == ("sampling: temperature 0.6, top-p 0.95, top-k 20 "
                                   "(the model's generation_config.json)")
    told = SamplingParams(temperature=0.6, top_p=0.95, top_k=20, max_tokens=12, seed=5, ignore_eos=True)
    assert llm.generate(PROMPT, max_tokens=12, seed=5, ignore_eos=True).token_ids == llm.generate(PROMPT, told).token_ids
    greedy = llm.generate(PROMPT, SamplingParams(max_tokens=12, ignore_eos=True))  # an explicit object is as built
    assert llm.generate(PROMPT, temperature=0, top_p=1.0, top_k=0, max_tokens=12, ignore_eos=True).token_ids == \
        greedy.token_ids


@pytest.mark.parametrize("config, expected", [
    ({"bos_token_id": 1}, (0.2, 0.9, 0, 1.1, "triforce's chat defaults; the model sets none")),
    ({"do_sample": False, "temperature": 0.7, "top_p": 0.8}, (0.0, 0.8, 0, 1.0, "generation_config.json")),
    ({"temperature": "hot", "repetition_penalty": 1.05}, (0.2, 0.9, 0, 1.1, "chat defaults")),  # see below
    ({"temperature": -1, "top_k": 2.5, "top_p": 0.5, "do_sample": True}, (1.0, 0.5, 0, 1.0, "generation_config")),
    ({"top_p": 0.5}, (0.0, 0.5, 0, 1.0, "generation_config.json")),
])
def test_what_a_generation_config_sets(tmp_path, tiny_model_dir, capsys, config, expected):
    from triforce.model.sampling_defaults import read_sampling_defaults

    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    got = read_sampling_defaults(tmp_path)
    p = got.params
    if config.get("temperature") == "hot":  # a bad value is left out, the good one kept, with a warning
        expected = (0.0, 1.0, 0, 1.05, "generation_config.json")  # no temperature, no do_sample: greedy
    assert (p.temperature, p.top_p, p.top_k, p.repeat_penalty) == expected[:4] and expected[4] in got.source
    warnings = capsys.readouterr().err
    assert ("ignored" in warnings) == any(v in ("hot", -1, 2.5) for v in config.values())


def test_a_gguf_files_sampling_fields_become_its_defaults(tmp_path, default_model_dir):
    from gguf import GGUFValueType

    from triforce.model.default_model import ensure_gguf
    path = copy_gguf(ensure_gguf(), tmp_path / "sampled.gguf", added={
        "general.sampling.temp": (0.7, GGUFValueType.FLOAT32), "general.sampling.top_k": (40, GGUFValueType.INT32),
        "general.sampling.top_p": (0.8, GGUFValueType.FLOAT32),
        "general.sampling.penalty_repeat": (1.05, GGUFValueType.FLOAT32)})
    defaults = _llm(path).get_default_sampling_params()
    assert (round(defaults.temperature, 6), defaults.top_k, round(defaults.top_p, 6),
            round(defaults.repeat_penalty, 6)) == (0.7, 40, 0.8, 1.05)


def test_the_server_and_chat_say_which_defaults_they_use(planted, tmp_path):
    from triforce.config import RunConfig
    from triforce.server.assembly import build_api

    _, lines = build_api(RunConfig(model=str(planted), dtype="float32"), batch_size=1, quiet=True)
    assert ("sampling: temperature 0.6, top-p 0.95, top-k 20 (the model's generation_config.json), where a "
            "request leaves a field out") in lines
    pexpect = pytest.importorskip("pexpect")
    exe = os.path.join(os.path.dirname(sys.executable), "triforce")
    for flags, said in (([], "top-k 20 (the model's generation_config.json)"),
                        (["--top-k", "5"], "top-k 5 (the model's generation_config.json; flags given over it)")):
        child = pexpect.spawn(exe, ["chat", "--model", str(planted), "--dtype", "float32", *flags], encoding="utf-8",
                              timeout=120, dimensions=(40, 400))
        child.expect_exact(said)
        child.terminate(force=True)
