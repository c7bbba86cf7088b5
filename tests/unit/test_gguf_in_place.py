"""A GGUF's weights read in place (triforce.model.gguf_weights) are what transformers' GGUF loader
makes of the same file, for files whose q and k rows llama.cpp permuted (llama) and whose it did
not (mistral, qwen2, qwen3), and a model loaded from the file gives the original checkpoint's logits."""
import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize
from safetensors.torch import load_file

from triforce.model.gguf_weights import SOURCE, GgufSource, gguf_name, hf_name, iter_gguf_tensors


def _llama_cpp_permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's converter does to a Llama checkpoint's q and k rows."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(
        weight.shape)


def write_gguf(folder, arch: str, kind: GGMLQuantizationType):
    """The checkpoint in `folder` written as `arch`'s GGUF file (matrices in `kind`, vectors F32)."""
    import json

    config = json.loads((folder / "config.json").read_text())
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    path = folder / f"model-{arch}.gguf"
    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    if config.get("head_dim"):
        writer.add_key_length(config["head_dim"])
        writer.add_value_length(config["head_dim"])
    if arch == "gemma3":  # as llama.cpp's converter writes it (conversion/gemma.py)
        writer.add_sliding_window(config["sliding_window"])
        writer.add_rope_freq_base(config["rope_parameters"]["full_attention"]["rope_theta"])
        writer.add_float32("gemma3.rope.freq_base_swa", config["rope_parameters"]["sliding_attention"]["rope_theta"])
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(config["rope_parameters"]["full_attention"]["factor"])
    for name, tensor in load_file(str(folder / "model.safetensors")).items():
        values = tensor.float().numpy()
        short = gguf_name(name, arch)
        if arch == "gemma3" and short.endswith("norm.weight"):
            values = values + 1  # Gemma's norms scale by 1 + weight: llama.cpp stores the sum
        if arch == "llama" and (".attn_q." in short or ".attn_k." in short):
            values = _llama_cpp_permute(values, heads if ".attn_q." in short else kv_heads)
        if values.ndim == 2 and kind != GGMLQuantizationType.F32:
            packed = quantize(values, kind)
            writer.add_tensor(short, packed, raw_shape=packed.shape, raw_dtype=kind)
        else:
            writer.add_tensor(short, np.ascontiguousarray(values))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path, arch, heads, kv_heads


def in_place(tmp_path, gguf_path, arch, heads, kv_heads):
    folder = tmp_path / f"converted-{arch}"
    folder.mkdir()
    GgufSource.of(gguf_path, arch, heads, kv_heads).write(folder)
    return folder


@pytest.mark.parametrize("family, arch", [("llama-gqa", "llama"), ("mistral", "llama"), ("qwen2", "qwen2"),
                                          ("qwen3", "qwen3")])
def test_weights_read_in_place_equal_transformers_loading_the_file(tiny_model_dir, tmp_path, family, arch):
    from transformers import AutoModelForCausalLM

    source = tiny_model_dir(family)
    gguf_path, *shape = write_gguf(source, arch, GGMLQuantizationType.Q8_0)
    theirs = AutoModelForCausalLM.from_pretrained(str(source), gguf_file=gguf_path.name, dtype=torch.float32)
    theirs = {name: value for name, value in theirs.state_dict().items() if hf_name(gguf_name(name))}
    ours = dict(iter_gguf_tensors(in_place(tmp_path, gguf_path, *shape) / SOURCE))
    if theirs["model.embed_tokens.weight"] is theirs.get("lm_head.weight") or "lm_head.weight" not in ours:
        theirs.pop("lm_head.weight", None)  # tied: one tensor in the file
    assert sorted(ours) == sorted(theirs)
    assert all(torch.equal(ours[name], theirs[name]) for name in ours), [
        name for name in ours if not torch.equal(ours[name], theirs[name])]


def test_a_model_loaded_from_its_file_gives_the_checkpoints_logits(tiny_model_dir, tmp_path):
    """Float32 tensors survive the file bit for bit, so q and k rows put back in the wrong order
    (or not at all) would change the logits."""
    import shutil

    from triforce.model.loading import load_model

    source = tiny_model_dir("llama-gqa")
    gguf_path, *shape = write_gguf(source, "llama", GGMLQuantizationType.F32)
    folder = in_place(tmp_path, gguf_path, *shape)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, folder / name)
    tokens = torch.tensor([[3, 9, 14, 5, 22, 7]])
    logits = [_logits(load_model(str(f), dtype="float32", device="cpu"), tokens) for f in (source, folder)]
    assert torch.equal(*logits)


def test_gemma3_from_its_file_gives_the_checkpoints_logits(tiny_model_dir, tmp_path):
    """Gemma 3's norms come back from llama.cpp's 1 + weight, and its post-attention, pre- and
    post-MLP norms from their GGUF names; a file written from a six-layer model (five windowed
    layers, one global) read in place gives the folder's logits over a prompt past the window."""
    import shutil

    from triforce.model.loading import load_model

    source = tiny_model_dir("gemma3-gguf", num_layers=6)
    gguf_path, *shape = write_gguf(source, "gemma3", GGMLQuantizationType.F32)
    folder = in_place(tmp_path, gguf_path, *shape)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, folder / name)
    tokens = torch.randint(3, 40, (1, 40), generator=torch.Generator().manual_seed(5))
    theirs, ours = (_logits(load_model(str(f), dtype="float32", device="cpu"), tokens) for f in (source, folder))
    assert (theirs - ours).abs().max() < 1e-5 and theirs.std() > 0.02  # logits that vary


def test_phi3_fused_matrices_run_as_the_files_blocks_cut_by_rows(tiny_model_dir, tmp_path):
    """A Phi-3 file keeps q/k/v and gate/up fused: each decoder matrix takes its rows of the file's
    Q8_0 blocks (checked against the floats the same file de-quantizes to), none made float when
    loaded as blocks, and the logits stay the floats'."""
    import shutil

    from triforce.model.loading import load_model
    from triforce.model.quantized import block_parameters, quantize_model

    source = tiny_model_dir("phi3")
    gguf_path, *shape = write_gguf(source, "phi3", GGMLQuantizationType.Q8_0)
    folder = in_place(tmp_path, gguf_path, *shape)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, folder / name)
    lm = load_model(str(folder), dtype="float32", device="cpu")
    tokens = torch.randint(3, 40, (1, 30), generator=torch.Generator().manual_seed(6))
    floats = _logits(lm, tokens)
    projections = sum(p.numel() for n, p in lm.model.named_parameters() if n.endswith("proj.weight"))
    made = quantize_model(lm.model, "gguf", gguf_path, architecture="phi3")
    assert made["weights"] == "q8_0" and made["block_weights"] >= projections > 0
    assert (_logits(lm, tokens) - floats).abs().max() < 1e-4
    skipped = block_parameters(GgufSource.read(folder), lm.config.num_layers)
    assert {f"model.layers.1.{m}.weight" for m in ("self_attn.q_proj", "self_attn.v_proj", "mlp.gate_proj",
                                                   "mlp.up_proj", "mlp.down_proj")} <= skipped
    assert not any(name.endswith(("qkv_proj.weight", "gate_up_proj.weight")) for name in skipped)


def _logits(lm, tokens):
    from triforce.cache.resident import ResidentKVCache

    step = ResidentKVCache(lm.config, tokens.shape[1], dtype=lm.dtype).step(tokens.shape[1])
    return lm.model(tokens, step.positions, step)


def test_a_changed_or_missing_file_is_named(tiny_model_dir, tmp_path):
    from triforce.errors import DamagedFileError

    source = tiny_model_dir("llama-mha")
    gguf_path, *shape = write_gguf(source, "llama", GGMLQuantizationType.F32)
    folder = in_place(tmp_path, gguf_path, *shape)
    with open(gguf_path, "ab") as f:
        f.write(b"\0")
    with pytest.raises(DamagedFileError, match="changed since it was converted"):
        next(iter_gguf_tensors(folder / SOURCE))
    gguf_path.unlink()
    with pytest.raises(DamagedFileError, match="is gone"):
        next(iter_gguf_tensors(folder / SOURCE))


def test_names_map_both_ways():
    for name in ("token_embd.weight", "output_norm.weight", "output.weight", "blk.3.attn_q.bias",
                 "blk.0.ffn_down.weight", "blk.11.attn_norm.weight", "blk.2.attn_output.weight"):
        assert gguf_name(hf_name(name)) == name
    assert hf_name("rope_freqs.weight") is None
    assert hf_name("blk.1.ffn_norm.weight") == "model.layers.1.post_attention_layernorm.weight"
    assert hf_name("blk.1.ffn_norm.weight", "gemma3") == "model.layers.1.pre_feedforward_layernorm.weight"
    for name in ("blk.1.ffn_norm.weight", "blk.1.post_attention_norm.weight", "blk.1.post_ffw_norm.weight"):
        assert gguf_name(hf_name(name, "gemma3"), "gemma3") == name
