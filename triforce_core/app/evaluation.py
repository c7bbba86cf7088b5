"""Evaluation: how well sparse caches stand in for the full cache, and needle prompts."""
from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from triforce.cache.sparse import SelectionPolicy
from triforce.config import SNAPKV_WINDOW, SamplingParams
from triforce.decoding.full_tier import FullTier
from triforce.decoding.sampling import probabilities
from triforce.decoding.tiers import SparseTier
from triforce.app.texts import natural_ids
from triforce.errors import UserError
from triforce.model.loading import LoadedModel

NEEDLE_INTRO = ("There is an important pass key hidden inside a lot of irrelevant text. "
                "Find it and memorize it. I will quiz you about the pass key.\n\n")
NEEDLE_FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
NEEDLE_QUESTION = "\n\nWhat is the pass key? The pass key is"
HAYSTACKS = ("natural", "repeated")


@dataclass(frozen=True)
class NeedlePrompt:
    text: str
    key: str
    tokens: int


def needle_prompt(tokenizer, context: int, depth: float = 0.5, seed: int = 0,
                  haystack: str = "natural") -> NeedlePrompt:
    """A pass key hidden at `depth` (0 = start, 1 = end) of about `context` tokens of haystack:
    natural text that never repeats itself (as RULER-style tests use essays), or `repeated`, one
    filler paragraph over and over (the model learns to recite it: a best case for speculation)."""
    if not 0 <= depth <= 1:
        raise UserError(f"--depth must be in [0, 1], got {depth}")
    if haystack not in HAYSTACKS:
        raise UserError(f"unknown haystack '{haystack}' (choose {', '.join(HAYSTACKS)})")
    key = str(random.Random(seed).randint(10000, 99999))
    needle = f"The pass key is {key}. Remember it. {key} is the pass key. "
    fixed = len(tokenizer(NEEDLE_INTRO + needle + NEEDLE_QUESTION).input_ids)
    per_filler = len(tokenizer(NEEDLE_FILLER * 20, add_special_tokens=False).input_ids) / 20
    room = context - fixed
    if room < per_filler:
        raise UserError(f"--context {context} is too short for a needle prompt (needs > {fixed + per_filler:.0f})")
    if haystack == "repeated":
        repeats = int(room / per_filler)
        before = int(repeats * depth)
        text = NEEDLE_INTRO + NEEDLE_FILLER * before + needle + NEEDLE_FILLER * (repeats - before) + NEEDLE_QUESTION
    else:
        length = len(tokenizer.decode(natural_ids(tokenizer, int(room))))
        hay = tokenizer.decode(natural_ids(tokenizer, int(room) + 256))
        hay = hay[:_sentence_end_near(hay, length)].rstrip()  # end on the whole sentence nearest the length
        cut = _sentence_end_near(hay, int(len(hay) * depth))
        text = NEEDLE_INTRO + hay[:cut] + (" " if cut and not hay[cut - 1].isspace() else "") + needle \
            + hay[cut:].lstrip() + NEEDLE_QUESTION
    return NeedlePrompt(text, key, len(tokenizer(text).input_ids))


def _sentence_end_near(text: str, position: int) -> int:
    """The end of the sentence nearest `position` (after its '. '), so the needle sits between
    sentences; the text's start or end at the extremes."""
    if position <= 0 or position >= len(text):
        return max(0, min(position, len(text)))
    before, after = text.rfind(". ", 0, position), text.find(". ", position)
    ends = [i + 2 for i in (before, after) if i >= 0]
    return min(ends, key=lambda e: abs(e - position)) if ends else position


def evaluate_acceptance(lm: LoadedModel, prompt_ids: list[int], budgets: list[int], policies: list[str],
                        gen: int, chunk_size: int = 8, sink_tokens: int = 16,
                        temperature: float = 0.6, progress=None, on_prefill=None) -> list[dict]:
    """Along the full cache's greedy continuation, how often the target over each sparse cache
    picks the same token, and its expected acceptance sum(min(p, q)) at `temperature`.

    Each sparse cache is selected once from the prompt (by the last prompt token's query) and,
    as in the engine, holds the exact KV of the continuation's earlier tokens."""
    if len(prompt_ids) < 2:
        raise UserError("the prompt must have at least two tokens")
    params = SamplingParams(temperature=temperature)
    full = FullTier(lm, len(prompt_ids) + gen)
    window = full.cover(prompt_ids[:-1], on_prefill, record_queries=SNAPKV_WINDOW if "snapkv" in policies else 1)[1]
    queries = [q[:, :, -1] for q in window]  # the last token's: retrieval and top-k select by it
    configs = [(kind, budget) for kind in policies for budget in budgets]
    tiers = {}
    for kind, budget in configs:
        tier = SparseTier(kind, lm, SelectionPolicy(kind, budget, chunk_size, sink_tokens), gen + 1)
        tier.rebuild(full.cache, window if kind == "snapkv" else queries)
        tiers[(kind, budget)] = tier
    # the full cache's greedy continuation, one row of logits per predicted token
    seq = list(prompt_ids)
    full_rows = []
    for _ in range(gen):
        row = full.logits(seq)[-1]
        full_rows.append(row)
        seq.append(int(torch.argmax(row)))
        if progress:
            progress(1)
    results = []
    for (kind, budget), tier in tiers.items():
        matches, accept = 0, 0.0
        for i in range(gen):
            position = len(prompt_ids) - 1 + i
            row = tier.logits(seq[:position + 1])[-1]
            tier.commit(full.cache, position, position + 1)  # exact KV, as after a verify
            matches += int(torch.argmax(row)) == seq[position + 1]
            p, q = probabilities(full_rows[i], params), probabilities(row, params)
            accept += float(torch.minimum(p, q).sum())
        results.append({"policy": kind, "budget": budget, "chunk_size": chunk_size,
                        "greedy_match": round(matches / gen, 4),
                        "expected_accept": round(accept / gen, 4)})
        if progress:
            progress(gen)
    return results

