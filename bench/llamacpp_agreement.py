"""Greedy agreement with llama.cpp on the same GGUF file: do our blocks and llama.cpp's compute the
same next tokens? Reported, never asserted: the two sum in different orders, llama.cpp keeps
its KV in float16 and rounds the activations to 8 bits for its integer dot products (ours multiply
float32 activations by the de-quantized blocks), so a near-tie may go either way.

    python -m triforce.bench.llamacpp_agreement --llama-completion ~/.cache/llamacpp/bin/llama-completion \\
        [--gguf FILE (default: the default model's shipped Q4_1 file)] [--new-tokens 32]

Ten held-out prompts (written for this script, used nowhere else), each continued greedily for
--new-tokens tokens with end-of-text ignored: by llama-completion (--temp 0) and by ours (`ar`
over the file's own blocks, float32 activations and KV). Printed per prompt: the tokens that
agree before the first difference (both texts tokenized by the model's tokenizer), and both
continuations; beside them, how many tokens our blocks share with our float32 run of the same
weights de-quantized (`--quantize none`): what float order alone changes."""
from __future__ import annotations

import json
import os
import platform
import subprocess
from pathlib import Path

import click
import torch

PROMPTS = (
    "The history of the printing press begins",
    "To make a simple loaf of bread, you need",
    "Photosynthesis is the process by which",
    "The main difference between a virus and a bacterium is",
    "In 1969, the first humans",
    "A good way to learn a new language is",
    "The river flowed slowly through the valley, and",
    "def fibonacci(n):",
    "The three states of matter are",
    "Once upon a time, in a small village by the sea,",
)


def theirs(binary: str, gguf: str, prompt: str, new_tokens: int, threads: int) -> str:
    env = dict(os.environ, LD_LIBRARY_PATH=str(Path(binary).parent))
    cmd = [binary, "-m", gguf, "-p", prompt, "-n", str(new_tokens), "--temp", "0", "--ignore-eos", "-no-cnv",
           "--no-display-prompt", "-t", str(threads), "-c", "512", "--no-warmup"]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, stdin=subprocess.DEVNULL, check=True)
    return done.stdout.removesuffix("\n\n")  # llama-completion ends its output with a blank line


def ours(lm, prompt: str, new_tokens: int) -> list[int]:
    from triforce.config import SamplingParams, SpecParams
    from triforce.decoding.engine import Engine

    ids = lm.tokenizer(prompt).input_ids
    engine = Engine(lm, SpecParams(method="ar"), len(ids) + new_tokens + 1)
    engine.set_sequence(ids)
    return engine.generate(new_tokens, SamplingParams(), frozenset()).tokens


def agreeing(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@click.command()
@click.option("--llama-completion", "binary", required=True, help="Path of llama.cpp's llama-completion.")
@click.option("--gguf", default=None, help="The GGUF both run (default: the default model's shipped file).")
@click.option("--new-tokens", type=click.IntRange(1, 256), default=32, show_default=True)
def main(binary: str, gguf: str | None, new_tokens: int) -> None:
    """Print each prompt's agreement, then a JSON summary (see the module docstring)."""
    from triforce.model.loading import gguf_file, load_model

    gguf = gguf or str(gguf_file("default"))
    lm = load_model(gguf, dtype="float32", device="cpu", quantize="gguf", quantize_required=False)
    floats = load_model(gguf, dtype="float32", device="cpu")  # the same weights de-quantized
    threads = torch.get_num_threads()
    rows = []
    for prompt in PROMPTS:
        mine = ours(lm, prompt, new_tokens)
        text = theirs(binary, gguf, prompt, new_tokens, threads)
        other = lm.tokenizer(text, add_special_tokens=False).input_ids[:new_tokens]
        same = agreeing(mine, other)
        rows.append({"prompt": prompt, "agree": same, "of": new_tokens,
                     "floats_agree": agreeing(mine, ours(floats, prompt, new_tokens)),
                     "ours": lm.tokenizer.decode(mine), "llamacpp": text})
        print(json.dumps(rows[-1]), flush=True)
    print(json.dumps({"machine": f"{platform.machine()} {threads} threads, torch {torch.__version__}",
                      "gguf": gguf, "weights": lm.quantized["weights"] if lm.quantized else None,
                      "identical": sum(r["agree"] == new_tokens for r in rows), "prompts": len(rows),
                      "agreeing_tokens": [r["agree"] for r in rows],
                      "blocks_vs_dequantized_floats": [r["floats_agree"] for r in rows]}))


if __name__ == "__main__":
    main()
