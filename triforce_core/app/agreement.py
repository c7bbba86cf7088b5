"""Greedy agreement: where two ways of computing the same model part, and why.

Two are measured (`triforce eval agreement`):
- bfloat16 speculation against bfloat16 AR. In float32/float64 they agree token for token (the
  tests check it); in bfloat16 a verify pass computes several tokens in one batched pass whose
  rounding differs from one-token steps, so a near-tie in AR's top two logits can go either way.
- our block-quantized AR against llama.cpp on the same GGUF file. The two sum in different orders,
  llama.cpp keeps its KV in float16 and rounds activations to 8 bits for its integer dot products,
  so a near-tie may go either way; beside it, our blocks against the same weights de-quantized
  (what float order alone changes).
Reported, never asserted: a part is a fact about rounding, not a defect."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import torch

from triforce.config import SamplingParams, SpecParams
from triforce.decoding.engine import Engine

# held-out prompts for the llama.cpp comparison (written for it, used nowhere else)
LLAMACPP_PROMPTS = (
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
SPECULATION = dict(budget=256, chunk_size=8, gamma1=3, gamma2=6)


def greedy(lm, spec: SpecParams, ids: list[int], new_tokens: int) -> list[int]:
    engine = Engine(lm, spec, len(ids) + new_tokens + 1, draft="lookup" if spec.uses_draft else None)
    engine.set_sequence(ids)
    return engine.generate(new_tokens, SamplingParams(), frozenset()).tokens


def agreeing(a: list[int], b: list[int]) -> int:
    """Tokens equal before the first difference."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def top2_margin(lm, ids: list[int]) -> float:
    """AR's top-1 minus top-2 logit for the token after `ids` (a one-token step, as AR takes it)."""
    from triforce.cache.resident import ResidentKVCache

    cache = ResidentKVCache(lm.config, len(ids), dtype=lm.dtype)
    step = cache.step(len(ids))
    logits = lm.model(torch.tensor([ids]), step.positions, step, num_logits=1)[0, -1].float()
    top = torch.topk(logits, 2).values
    return float(top[0] - top[1])


def speculation_rows(lm, prompts: list[list[int]], new_tokens: int, methods: list[str], on_row=None) -> list[dict]:
    """Each prompt decoded by AR and by each method: identical or not, where they part, and AR's
    top-2 logit margin there."""
    rows = []
    for i, ids in enumerate(prompts):
        ar = greedy(lm, SpecParams(method="ar"), ids, new_tokens)
        for method in methods:
            got = greedy(lm, SpecParams(method=method, **SPECULATION), ids, new_tokens)
            part = agreeing(ar, got)
            row = {"prompt": i, "method": method, "identical": got == ar, "parts_at": None if got == ar else part}
            if got != ar:
                row["ar_top2_margin"] = round(top2_margin(lm, ids + ar[:part]), 4)
            rows.append(row)
            if on_row:
                on_row(row)
    return rows


def llamacpp_text(binary: str, gguf: str, prompt: str, new_tokens: int, threads: int) -> str:
    """llama-completion's greedy continuation (end-of-text ignored)."""
    env = dict(os.environ, LD_LIBRARY_PATH=str(Path(binary).parent))
    cmd = [binary, "-m", gguf, "-p", prompt, "-n", str(new_tokens), "--temp", "0", "--ignore-eos", "-no-cnv",
           "--no-display-prompt", "-t", str(threads), "-c", "512", "--no-warmup"]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, stdin=subprocess.DEVNULL, check=True)
    return done.stdout.removesuffix("\n\n")  # llama-completion ends its output with a blank line


def llamacpp_rows(blocks, floats, binary: str, gguf: str, new_tokens: int, threads: int, on_row=None) -> list[dict]:
    """Each held-out prompt continued by llama.cpp, by our blocks and by our de-quantized floats."""
    rows = []
    for prompt in LLAMACPP_PROMPTS:
        ids = blocks.tokenizer(prompt).input_ids
        mine = greedy(blocks, SpecParams(method="ar"), ids, new_tokens)
        text = llamacpp_text(binary, gguf, prompt, new_tokens, threads)
        other = blocks.tokenizer(text, add_special_tokens=False).input_ids[:new_tokens]
        rows.append({"prompt": prompt, "agree": agreeing(mine, other), "of": new_tokens,
                     "floats_agree": agreeing(mine, greedy(floats, SpecParams(method="ar"), ids, new_tokens)),
                     "ours": blocks.tokenizer.decode(mine), "llamacpp": text})
        if on_row:
            on_row(rows[-1])
    return rows
