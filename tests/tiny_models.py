"""Tiny random checkpoints of each supported family, written as real Hugging Face folders
(config, safetensors, a small character-level tokenizer) so the real loaders read them."""
from __future__ import annotations

import string
from pathlib import Path

import torch

ALPHABET = string.ascii_lowercase + string.digits + " .,!?\n"

FAMILIES = {
    "llama-mha": dict(model_type="llama", num_attention_heads=4, num_key_value_heads=4),
    "llama-gqa": dict(model_type="llama", num_attention_heads=4, num_key_value_heads=2),
    "mistral": dict(model_type="mistral", num_attention_heads=4, num_key_value_heads=2, sliding_window=24),
    "qwen2": dict(model_type="qwen2", num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
    # Llama 3.2 (1B/3B): tied embeddings under Llama 3's rope scaling
    "llama3.2": dict(model_type="llama", num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                     rope_parameters={"rope_type": "llama3", "factor": 32.0, "rope_theta": 500000.0,
                                      "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                      "original_max_position_embeddings": 32}),
    # Mistral Small 3.x: no sliding window, heads narrower than hidden / heads
    "mistral-small": dict(model_type="mistral", num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                          sliding_window=None),
    # q/k norms, no qkv bias, heads of 128 whatever hidden / heads (transformers reads no other width from a GGUF)
    "qwen3": dict(model_type="qwen3", num_attention_heads=4, num_key_value_heads=2, head_dim=128),
    # Phi-3: fused qkv and gate/up, LongRoPE (trained on 16 tokens here: the tests' prompts pass it in one
    # pass, where transformers and triforce both take the long factors), a window over every layer
    "phi3": dict(model_type="phi3", num_attention_heads=4, num_key_value_heads=2, sliding_window=24,
                 original_max_position_embeddings=16,
                 rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                  "short_factor": [1.0, 1.1, 1.2, 1.5, 2.0, 2.5, 3.0, 4.0],
                                  "long_factor": [1.0, 1.3, 1.9, 2.8, 4.0, 6.0, 9.0, 12.0]}),
    # Phi-4-mini: RoPE turns the first 3/4 of each head, tied embeddings
    "phi4-mini": dict(model_type="phi3", num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75}),
    # Gemma 3: local (windowed) and global layers by turns, each kind with its RoPE (the global one scaled,
    # as 4B and up are), q/k norms, norms around attention and MLP scaling by 1 + weight (drawn here, so
    # they matter), GELU, scaled embeddings (drawn narrower: times sqrt(hidden), wider ones made every
    # continuation repeat its last token), tied head, and a query scale that is not 1/sqrt(head_dim)
    "gemma3": dict(model_type="gemma3_text", num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                   sliding_window=12, sliding_window_pattern=2, query_pre_attn_scalar=24, _norm_std=0.3,
                   _embed_std=0.01,
                   rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                    "full_attention": {"rope_type": "linear", "factor": 4.0,
                                                       "rope_theta": 1000000.0}}),
    # Gemma 3 as a GGUF says it: llama.cpp reads every sixth layer as global and 1/sqrt(head_dim) as the
    # query scale (for all but its 27B) from a file that holds neither
    "gemma3-gguf": dict(model_type="gemma3_text", num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                        sliding_window=12, query_pre_attn_scalar=16, _norm_std=0.3, _embed_std=0.01,
                        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                         "full_attention": {"rope_type": "linear", "factor": 4.0,
                                                            "rope_theta": 1000000.0}}),
    # Gemma 3 4B and up: a multimodal folder (text_config, a vision tower, the language model's tensors
    # under language_model.model.*) whose text model runs
    "gemma3-multimodal": dict(model_type="gemma3", _text_type="gemma3_text", num_attention_heads=4,
                              num_key_value_heads=2, head_dim=16, sliding_window=12, sliding_window_pattern=2,
                              _norm_std=0.3, _embed_std=0.01, _vision_config=dict(hidden_size=32, intermediate_size=64,
                                                                 num_hidden_layers=1, num_attention_heads=2,
                                                                 image_size=28, patch_size=14)),
    "llama-yarn": dict(model_type="llama", num_attention_heads=4, num_key_value_heads=2,
                       rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                        "original_max_position_embeddings": 32}),
    "llama-linear": dict(model_type="llama", num_attention_heads=4, num_key_value_heads=4,
                         rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}),
    "llama-dynamic": dict(model_type="llama", num_attention_heads=4, num_key_value_heads=2,
                          rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}),
    "llama3-rope": dict(model_type="llama", num_attention_heads=4, num_key_value_heads=2,
                        rope_parameters={"rope_type": "llama3", "factor": 8.0, "rope_theta": 500000.0,
                                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                         "original_max_position_embeddings": 32}),
}


def char_tokenizer(alphabet: str = ALPHABET):
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for ch in alphabet:
        vocab[ch] = len(vocab)
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>")


def make_tiny_model(folder: Path, family: str, *, seed: int = 0, hidden_size: int = 64,
                    num_layers: int = 2, max_position_embeddings: int = 128, alphabet: str = ALPHABET,
                    weight_std: float = 0.15, tokenizer=None) -> Path:
    """Write a random tiny model of `family` to `folder` and return it. `tokenizer` (a folder or
    tokenizer object) replaces the character tokenizer, e.g. to make a draft for a real model."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as transformers_logging

    # its "Writing model shards" bar would land in the stderr of whichever test first asks for the model
    transformers_logging.disable_progress_bar()

    spec = dict(FAMILIES[family])
    model_type = spec.pop("model_type")
    norm_std = spec.pop("_norm_std", 0.0)  # norms drawn around their identity (Gemma's 0, the others' 1)
    embed_std = spec.pop("_embed_std", weight_std)
    if tokenizer is None:
        tokenizer = char_tokenizer(alphabet)
    elif isinstance(tokenizer, (str, Path)):
        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer))
    vision, text_type = spec.pop("_vision_config", None), spec.pop("_text_type", None)
    text = dict(vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                num_hidden_layers=num_layers, max_position_embeddings=max_position_embeddings,
                bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=0, **spec)
    if vision is None:
        config = AutoConfig.for_model(model_type, **text)
    else:
        config = AutoConfig.for_model(model_type, text_config=dict(model_type=text_type, **text), vision_config=vision,
                                      mm_tokens_per_image=4)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # wider weights than the default init, so logits are far from uniform
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, embed_std if name.endswith("embed_tokens.weight") else weight_std)
            elif name.endswith("bias"):
                p.normal_(0, 0.05)
            elif norm_std and name.endswith("norm.weight"):
                p.normal_(0, norm_std)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
