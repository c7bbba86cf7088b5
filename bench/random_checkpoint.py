"""A Llama checkpoint with random weights (std 0.02) and the default model's tokenizer, in a shape
of your choosing: for timing formats the default model's shape cannot take (Q4_K needs rows of
whole 256-weight super-blocks; SmolLM2-135M's are 576 wide). Its text is noise; its speed is
its shape's.

    python -m triforce.bench.random_checkpoint OUT_DIR [--hidden 768 --intermediate 2048 --layers 12
                                                        --heads 12 --kv-heads 4]

Then, for llama.cpp and ours on the same blocks:
    bash ../shared/tools/build_llamacpp.sh ~/.cache/llamacpp OUT_DIR f32 OUT-f32.gguf
    llama-quantize --pure OUT-f32.gguf OUT-q4_k.gguf Q4_K_M
    python -m triforce.bench.vs_llamacpp --llama-bench .../llama-bench --model OUT-q4_k.gguf \\
        --gguf gguf=OUT-q4_k.gguf"""
from __future__ import annotations

import shutil
from pathlib import Path

import click
import torch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


@click.command()
@click.argument("out_dir", type=click.Path(file_okay=False))
@click.option("--hidden", type=int, default=768, show_default=True)
@click.option("--intermediate", type=int, default=2048, show_default=True)
@click.option("--layers", type=int, default=12, show_default=True)
@click.option("--heads", type=int, default=12, show_default=True)
@click.option("--kv-heads", type=int, default=4, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
def main(out_dir: str, hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, seed: int) -> None:
    """Write the checkpoint to OUT_DIR (see the module docstring)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from triforce.model.default_model import default_model_dir

    source = default_model_dir()
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=49152, hidden_size=hidden, intermediate_size=intermediate,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=True,
                         bos_token_id=1, eos_token_id=2, initializer_range=0.02)
    model = LlamaForCausalLM(config)
    out = Path(out_dir)
    model.save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (source / name).exists():
            shutil.copy(source / name, out / name)
    params = sum(p.numel() for p in model.parameters())
    print(f"{out}: {params / 1e6:.1f}M parameters, hidden {hidden}, intermediate {intermediate}, {layers} layers")


if __name__ == "__main__":
    main()
