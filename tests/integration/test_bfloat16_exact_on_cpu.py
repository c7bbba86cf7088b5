"""On the CPU, greedy speculative decoding in bfloat16 gives AR's tokens exactly: the small-rows
linear kernels and the decoding-attention kernel compute each token of a verify pass (up to 16
tokens) as a one-token step would, so no near-tie can be rounded two ways.

The prompt is the passage of bench/bf16_agreement.py where, through PyTorch's SDPA and F.linear,
triforce and AR parted at token 13 (AR's top-2 logit margin 0.047; bench/RESULTS.md)."""
import pytest

from triforce.config import SamplingParams, SpecParams
from triforce.decoding.engine import Engine


@pytest.fixture(scope="module")
def bf16_lm(default_model_dir):
    from triforce.model.loading import load_model
    return load_model(str(default_model_dir), dtype="bfloat16", device="cpu")


def _passage(tokenizer, index: int = 2, prompts: int = 20, tokens: int = 512) -> list[int]:
    from triforce.app.texts import stdlib_prose

    words = stdlib_prose().split()
    start = (index * len(words)) // prompts
    return tokenizer(" ".join(words[start:start + tokens]), add_special_tokens=False).input_ids[:tokens]


def _greedy(lm, spec, ids, new_tokens):
    engine = Engine(lm, spec, len(ids) + new_tokens + 1, draft="lookup")
    engine.set_sequence(ids)
    return engine.generate(new_tokens, SamplingParams()).tokens


def test_greedy_speculation_in_bfloat16_equals_ar(bf16_lm):
    ids = _passage(bf16_lm.tokenizer)
    ar = _greedy(bf16_lm, SpecParams(method="ar"), ids, 20)
    for method in ("triforce", "retrieval"):
        spec = SpecParams(method=method, budget=256, chunk_size=8, gamma1=3, gamma2=6)
        assert _greedy(bf16_lm, spec, ids, 20) == ar, method
