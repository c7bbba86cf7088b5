"""Named architectures for `--arch`: real model shapes with random weights, for planning and
timing only (random weights cannot accept drafts honestly; benchmarks replay recorded traces)."""
from __future__ import annotations

from types import SimpleNamespace

from triforce.config.model import ModelConfig
from triforce.errors import UserError

_LLAMA2_7B = dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=32, rms_norm_eps=1e-5)


def _gemma3(layers: int, **fields) -> dict:
    """Gemma 3 (4B and up): five local layers (a 1024-token window, RoPE base 1e4) to each global one
    (base 1e6, linear scaling x8 to 128K), GELU, q/k norms, norms around attention and MLP."""
    kinds = ["sliding_attention"] * 5 + ["full_attention"]
    return dict(model_type="gemma3_text", vocab_size=262208, rms_norm_eps=1e-6, max_position_embeddings=131072,
                num_hidden_layers=layers, layer_types=[kinds[i % 6] for i in range(layers)], sliding_window=1024,
                hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True,
                rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                 "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}},
                **fields)


# transformers config fields of each architecture (Llama family; model_type names another)
ARCHITECTURES = {
    "llama2-7b-128k": dict(_LLAMA2_7B, max_position_embeddings=131072,  # Yarn-Llama-2-7b-128k
                           rope_parameters={"rope_type": "yarn", "factor": 32.0, "rope_theta": 10000.0,
                                            "original_max_position_embeddings": 4096}),
    "llama2-13b-128k": dict(vocab_size=32000, hidden_size=5120, intermediate_size=13824, num_hidden_layers=40,
                            num_attention_heads=40, num_key_value_heads=40, rms_norm_eps=1e-5,
                            max_position_embeddings=131072,
                            rope_parameters={"rope_type": "yarn", "factor": 32.0, "rope_theta": 10000.0,
                                             "original_max_position_embeddings": 4096}),
    "lwm-text-chat-128k": dict(_LLAMA2_7B, max_position_embeddings=131072,
                               rope_parameters={"rope_type": "default", "rope_theta": 10000000.0}),
    "llama3.1-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                        num_attention_heads=32, num_key_value_heads=8, rms_norm_eps=1e-5,
                        max_position_embeddings=131072,
                        rope_parameters={"rope_type": "llama3", "factor": 8.0, "rope_theta": 500000.0,
                                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                         "original_max_position_embeddings": 8192}),
    # the north star of block-quantized weights (q4_k): a 32B-class GQA model at 128K on one 24 GB card
    "qwen2.5-32b-128k": dict(model_type="qwen2", vocab_size=152064, hidden_size=5120, intermediate_size=27648,
                             num_hidden_layers=64, num_attention_heads=40, num_key_value_heads=8, rms_norm_eps=1e-6,
                             max_position_embeddings=131072,
                             rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1000000.0,
                                              "original_max_position_embeddings": 32768}),
    "llama3.2-3b": dict(vocab_size=128256, hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
                        num_attention_heads=24, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5,
                        max_position_embeddings=131072, tie_word_embeddings=True,
                        rope_parameters={"rope_type": "llama3", "factor": 32.0, "rope_theta": 500000.0,
                                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                         "original_max_position_embeddings": 8192}),
    # Mistral Small 3.1 (24B): full attention to 128K, rope base 1e9
    "mistral-small-24b": dict(model_type="mistral", vocab_size=131072, hidden_size=5120, intermediate_size=32768,
                              num_hidden_layers=40, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                              rms_norm_eps=1e-5, max_position_embeddings=131072, sliding_window=None,
                              rope_parameters={"rope_type": "default", "rope_theta": 1000000000.0}),
    # Qwen3 dense (q/k norms, no qkv bias): 32K native, 128K with YaRN x4 as its model card says
    "qwen3-8b-128k": dict(model_type="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                          num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                          rms_norm_eps=1e-6, max_position_embeddings=131072,
                          rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1000000.0,
                                           "original_max_position_embeddings": 32768}),
    "qwen3-32b-128k": dict(model_type="qwen3", vocab_size=151936, hidden_size=5120, intermediate_size=25600,
                           num_hidden_layers=64, num_attention_heads=64, num_key_value_heads=8, head_dim=128,
                           rms_norm_eps=1e-6, max_position_embeddings=131072,
                           rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1000000.0,
                                            "original_max_position_embeddings": 32768}),
    # Phi-3/Phi-4 (fused qkv and gate/up in their files; shapes here). The 128K models' LongRoPE factors are
    # weights-like data of each release, not shape: plain RoPE stands in for timing and planning
    "phi3-mini-128k": dict(model_type="phi3", vocab_size=32064, hidden_size=3072, intermediate_size=8192,
                           num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32, rms_norm_eps=1e-5,
                           max_position_embeddings=131072, sliding_window=None),
    "phi4-mini-128k": dict(model_type="phi3", vocab_size=200064, hidden_size=3072, intermediate_size=8192,
                           num_hidden_layers=32, num_attention_heads=24, num_key_value_heads=8, rms_norm_eps=1e-5,
                           max_position_embeddings=131072, tie_word_embeddings=True, sliding_window=None,
                           rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                            "partial_rotary_factor": 0.75}),
    "phi4-14b": dict(model_type="phi3", vocab_size=100352, hidden_size=5120, intermediate_size=17920,
                     num_hidden_layers=40, num_attention_heads=40, num_key_value_heads=10, rms_norm_eps=1e-5,
                     max_position_embeddings=16384, sliding_window=None,
                     rope_parameters={"rope_type": "default", "rope_theta": 250000.0}),
    "gemma3-4b": _gemma3(34, hidden_size=2560, intermediate_size=10240, num_attention_heads=8,
                         num_key_value_heads=4, head_dim=256, query_pre_attn_scalar=256),
    "gemma3-12b": _gemma3(48, hidden_size=3840, intermediate_size=15360, num_attention_heads=16,
                          num_key_value_heads=8, head_dim=256, query_pre_attn_scalar=256),
    "gemma3-27b": _gemma3(62, hidden_size=5376, intermediate_size=21504, num_attention_heads=32,
                          num_key_value_heads=16, head_dim=128, query_pre_attn_scalar=168),
    "llama-68m": dict(vocab_size=32000, hidden_size=768, intermediate_size=3072, num_hidden_layers=2,
                      num_attention_heads=12, num_key_value_heads=12, rms_norm_eps=1e-6,
                      max_position_embeddings=2048),  # the paper's tier-0 draft
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, rms_norm_eps=1e-5,
                         max_position_embeddings=8192, tie_word_embeddings=True,
                         rope_parameters={"rope_type": "default", "rope_theta": 100000.0}),
    # a Qwen3 block small enough for a CPU, in whole 256-weight rows (q4_k files: bench/random_gguf.py)
    "qwen3-tiny-test": dict(model_type="qwen3", vocab_size=49152, hidden_size=256, intermediate_size=512,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                            rms_norm_eps=1e-6, max_position_embeddings=4096),
    "tiny-test": dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
                      max_position_embeddings=4096),
}


# the names people type for each (Hugging Face repos without their org, Ollama's tags), lower case
ALIASES = {
    "llama2-7b-128k": ("yarn-llama-2-7b-128k",), "llama2-13b-128k": ("yarn-llama-2-13b-128k",),
    "llama3.1-8b": ("llama-3.1-8b", "llama-3.1-8b-instruct", "meta-llama-3.1-8b", "meta-llama-3.1-8b-instruct",
                    "llama3.1:8b"),
    "qwen2.5-32b-128k": ("qwen2.5-32b", "qwen2.5-32b-instruct", "qwen2.5:32b"),
    "llama3.2-3b": ("llama-3.2-3b", "llama-3.2-3b-instruct", "llama3.2:3b"),
    "mistral-small-24b": ("mistral-small-24b-instruct-2501", "mistral-small-24b-base-2501", "mistral-small:24b"),
    "qwen3-8b-128k": ("qwen3-8b", "qwen3-8b-base", "qwen3:8b"),
    "qwen3-32b-128k": ("qwen3-32b", "qwen3:32b"),
    "phi3-mini-128k": ("phi-3-mini-128k-instruct", "phi3:3.8b-mini-128k-instruct"),
    "phi4-mini-128k": ("phi-4-mini-instruct", "phi4-mini", "phi4-mini:3.8b"),
    "phi4-14b": ("phi-4", "phi4", "phi4:14b"),
    "gemma3-4b": ("gemma-3-4b-it", "gemma-3-4b-pt", "gemma3:4b"),
    "gemma3-12b": ("gemma-3-12b-it", "gemma-3-12b-pt", "gemma3:12b"),
    "gemma3-27b": ("gemma-3-27b-it", "gemma-3-27b-pt", "gemma3:27b"),
    "smollm2-135m": ("smollm2-135m-instruct", "smollm2:135m"),
}
_BY_ALIAS = {alias: name for name, aliases in ALIASES.items() for alias in aliases}


def arch_name(given: str) -> str:
    """The architecture a name means: one of ARCHITECTURES, a Hugging Face repo id of the model
    (meta-llama/Llama-3.1-8B-Instruct, Qwen/Qwen3-32B-GGUF) or an Ollama name (qwen3:32b)."""
    if given in ARCHITECTURES:
        return given
    key = given.strip().lower().rsplit("/", 1)[-1].removesuffix(":latest").removesuffix("-gguf")
    name = key if key in ARCHITECTURES else _BY_ALIAS.get(key)
    if name is None:
        raise UserError(f"unknown architecture '{given}' (known: {', '.join(ARCHITECTURES)}; Hugging Face and "
                        "Ollama names of those models work too, e.g. meta-llama/Llama-3.1-8B-Instruct, qwen3:32b)")
    return name


def arch_hf_config(name: str):
    name = arch_name(name)
    from transformers import Gemma3TextConfig, LlamaConfig, MistralConfig, Phi3Config, Qwen2Config, Qwen3Config
    fields = dict(ARCHITECTURES[name])
    kinds = {"qwen2": Qwen2Config, "qwen3": Qwen3Config, "mistral": MistralConfig, "phi3": Phi3Config,
             "gemma3_text": Gemma3TextConfig}
    return kinds.get(fields.pop("model_type", "llama"), LlamaConfig)(**fields)


def arch_config(name: str) -> ModelConfig:
    """Shapes only, without importing torch or transformers (so `triforce plan` starts fast)."""
    name = arch_name(name)
    fields = dict(model_type="llama", tie_word_embeddings=False, attention_bias=False, mlp_bias=False)
    return ModelConfig.from_hf(SimpleNamespace(**{**fields, **ARCHITECTURES[name]}))


def build_random_model(name: str, dtype: str = "auto", device: str = "auto", seed: int = 0,
                       shard: tuple[int, int] | None = None, rope_scaling: tuple[int, str] | None = None,
                       quantize: str | None = None):
    """A LoadedModel of architecture `name` with random weights (std 0.02), made on `device`
    directly. It has no tokenizer; its `path` says it is random. rope_scaling: see load_model.
    quantize: projections and head as random blocks of that format (triforce.model.quantized)."""
    from pathlib import Path

    import torch

    from triforce.model.loading import LoadedModel, resolve_device, resolve_dtype
    from triforce.model.decoder import CausalLM
    from triforce.model.rope import layer_ropes

    hf = arch_hf_config(name)
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    cfg = ModelConfig.from_hf(hf)
    if rope_scaling is not None:
        from dataclasses import replace

        from triforce.model.context_stretch import stretch
        hf, context = stretch(hf, *rope_scaling)
        cfg = replace(cfg, max_position_embeddings=context)
    ropes = layer_ropes(hf, cfg.num_layers)
    with torch.device("meta"):
        model = CausalLM(cfg, ropes).to(torch_dtype)
    if shard is not None:  # a rank's tensor-parallel share only: the whole model may not fit one card
        from triforce.model.tensor_parallel import shard_meta_model
        shard_meta_model(model, *shard)
    quantized = None
    if quantize is not None:
        if shard is not None:
            raise UserError("--quantize runs on one process so far (no tensor parallelism for block weights yet)")
        from triforce.model.quantized import random_blocks_into
        quantized = random_blocks_into(model, quantize, torch_device,
                                       torch.Generator(device=torch_device).manual_seed(seed + 1))
    # cast on the meta device, then allocate: building in float32 first would need twice the
    # memory of bf16 weights on the device (a 7B model would not fit a 24 GB card)
    if torch_device.type == "cpu":
        from triforce.model.host_memory import check_host_room, meta_model_bytes
        check_host_room(meta_model_bytes(model, torch_dtype), f"{name} in {str(torch_dtype).removeprefix('torch.')}",
                        "a smaller architecture, --dtype bfloat16, or --tp over more ranks")
    model = model.to_empty(device=torch_device)
    generator = torch.Generator(device=torch_device).manual_seed(seed)
    with torch.no_grad():
        for param_name, p in model.named_parameters():
            if param_name.endswith("norm.weight"):
                p.fill_(0.0 if cfg.gemma_norms else 1.0)  # Gemma's norms scale by 1 + weight
            elif p.dim() == 2:
                p.normal_(0, 0.02, generator=generator)
            else:
                p.zero_()
    if quantized is None:  # random blocks give the head its own weights
        model.tie_weights()
    model.use_kernels("fused")
    return LoadedModel(model.eval(), None, Path(f"random:{name}"), torch_dtype, torch_device, frozenset(),
                       quantized=quantized)
