"""GGUF files as llama.cpp writes them. With llama.cpp's own converter (convert_hf_to_gguf.py, found
through LLAMACPP_CONVERT or a llama.cpp source tree under ~/.cache/llamacpp): a tiny model of each
family written to GGUF in float32 and loaded from the file gives the folder's logits. Without it:
what llama.cpp reads from a Gemma 3 file's metadata that transformers' GGUF reader leaves out."""
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from triforce.model.loading import load_model
from triforce.decoding.full_tier import FullTier


def converter() -> Path | None:
    """The converter, where it and the sentencepiece package it imports are here."""
    import importlib.util

    named = os.environ.get("LLAMACPP_CONVERT")
    found = [Path(named)] if named else sorted(
        Path.home().glob(".cache/llamacpp/src/*/vendor/llama.cpp/convert_hf_to_gguf.py"))
    return found[-1] if found and importlib.util.find_spec("sentencepiece") else None


NO_CONVERTER = "llama.cpp's convert_hf_to_gguf.py (LLAMACPP_CONVERT) or sentencepiece missing"


@pytest.mark.skipif(converter() is None, reason=NO_CONVERTER)
@pytest.mark.parametrize("family", ["llama-gqa", "qwen3", "gemma3-gguf"])
def test_a_file_from_llama_cpps_converter_gives_the_folders_logits(family, default_model_dir, tmp_path, monkeypatch):
    """SmolLM2's tokenizer, which the converter knows (under a Qwen2 config transformers hands it a
    tokenizer whose pre-tokenizer the converter does not recognise); six layers, so Gemma 3 has a
    global one. (Needs the gguf and sentencepiece packages the converter imports.)"""
    from tiny_models import make_tiny_model

    folder = make_tiny_model(tmp_path / family, family, num_layers=6, max_position_embeddings=128,
                             tokenizer=default_model_dir, seed=3)
    gguf = tmp_path / f"{family}.gguf"
    done = subprocess.run([sys.executable, str(converter()), str(folder), "--outtype", "f32", "--outfile", str(gguf)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    monkeypatch.setenv("TRIFORCE_CACHE", str(tmp_path / "cache"))
    ids = list(range(100, 160))  # past the 12-token window
    theirs, ours = (FullTier(lm, len(ids)).forward(ids) for lm in
                    (load_model(str(p), dtype="float32", device="cpu") for p in (folder, gguf)))
    assert (theirs - ours).abs().max() < 1e-4 and theirs.std() > 0.02


def sentencepiece_model(folder: Path) -> None:
    """A character-level SentencePiece tokenizer.model in `folder` (llama.cpp's Phi-3 converter
    reads only that kind), no larger than the model's vocabulary."""
    import sentencepiece

    text = folder / "corpus.txt"
    text.write_text("the quick brown fox jumps over the lazy dog\n" * 20)
    sentencepiece.SentencePieceTrainer.train(input=str(text), model_prefix=str(folder / "tokenizer"), vocab_size=30,
                                             model_type="char", hard_vocab_limit=False, minloglevel=2)


@pytest.mark.skipif(converter() is None, reason=NO_CONVERTER)
@pytest.mark.parametrize("family", ["phi3", "phi4-mini"])
def test_a_phi3_file_from_llama_cpps_converter_gives_the_folders_logits(family, tmp_path, monkeypatch):
    """Fused q/k/v and gate/up read from their file matrices, LongRoPE's factors from the file's
    rope_factors tensors, Phi-4-mini's partial rotary from its dimension count."""
    from tiny_models import make_tiny_model

    folder = make_tiny_model(tmp_path / family, family, max_position_embeddings=128, seed=3)
    sentencepiece_model(folder)
    gguf = tmp_path / f"{family}.gguf"
    done = subprocess.run([sys.executable, str(converter()), str(folder), "--outtype", "f32", "--outfile", str(gguf)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    monkeypatch.setenv("TRIFORCE_CACHE", str(tmp_path / "cache"))
    ids = list(range(3, 28)) * 2  # past the 24-token window and the 16 trained tokens
    models = [load_model(str(p), dtype="float32", device="cpu") for p in (folder, gguf)]
    assert models[0].config == replace(models[1].config, rms_norm_eps=models[0].config.rms_norm_eps)  # float32 in files
    theirs, ours = (FullTier(lm, len(ids)).forward(ids) for lm in models)
    assert (theirs - ours).abs().max() < 1e-4 and theirs.std() > 0.02


def metadata_only_gguf(path: Path, layers: int, **fields):
    """A GGUF file holding only these fields (no tensors), opened for reading."""
    from gguf import GGUFReader, GGUFWriter

    writer = GGUFWriter(str(path), "gemma3")
    writer.add_block_count(layers)
    for key, value in fields.items():
        writer.add_key_value(f"gemma3.{key}", *value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return GGUFReader(str(path))


def test_gemma3_config_is_what_llama_cpp_reads_from_the_file(tmp_path):
    """Every sixth layer global unless the file says otherwise, the global layers' linear scaling,
    the local base, and the query scale llama.cpp takes for its 27B (62 layers: 1/sqrt(hidden /
    heads)) and for every other size (1/sqrt(head_dim))."""
    from gguf import GGUFValueType
    from transformers import Gemma3TextConfig

    from triforce.config.model import ModelConfig
    from triforce.model.gguf_convert import _gemma3_as_llama_cpp_reads_it

    floats = GGUFValueType.FLOAT32
    common = {"attention.sliding_window": (1024, GGUFValueType.UINT32), "attention.key_length": (128, GGUFValueType.UINT32),
              "rope.freq_base": (1e6, floats), "rope.freq_base_swa": (1e4, floats),
              "rope.scaling.type": ("linear", GGUFValueType.STRING), "rope.scaling.factor": (8.0, floats)}
    for layers, scalar in ((62, 168), (48, 128)):
        config = Gemma3TextConfig(num_hidden_layers=layers, hidden_size=5376, num_attention_heads=32,
                                  num_key_value_heads=16, head_dim=128, query_pre_attn_scalar=256)
        _gemma3_as_llama_cpp_reads_it(config, metadata_only_gguf(tmp_path / f"{layers}.gguf", layers, **common))
        cfg = ModelConfig.from_hf(config)
        assert config.query_pre_attn_scalar == scalar and cfg.sliding_windows[:6] == (1024,) * 5 + (None,)
        assert config.rope_parameters["full_attention"] == {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}
        assert config.rope_parameters["sliding_attention"] == {"rope_type": "default", "rope_theta": 1e4}
    config = Gemma3TextConfig(num_hidden_layers=4, hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
    every_other = metadata_only_gguf(tmp_path / "pattern.gguf", 4, **common,
                                     **{"attention.sliding_window_pattern": (2, GGUFValueType.UINT32)})
    _gemma3_as_llama_cpp_reads_it(config, every_other)
    assert config.layer_types == ["sliding_attention", "full_attention"] * 2
    no_window = metadata_only_gguf(tmp_path / "none.gguf", 4, **{"attention.key_length": (16, GGUFValueType.UINT32)})
    _gemma3_as_llama_cpp_reads_it(config, no_window)
    assert config.layer_types == ["full_attention"] * 4 and config.rope_parameters["full_attention"]["rope_type"] == "default"
