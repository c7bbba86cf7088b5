"""Our model against transformers' own: logits within 1e-4 (float32), greedy continuations equal."""
import pytest
import torch

from triforce.config import SamplingParams, SpecParams
from triforce.decoding.engine import Engine
from triforce.decoding.full_tier import FullTier
from triforce.model.loading import load_model
from tiny_models import FAMILIES

SEQ_LEN = 72  # past the 32-token original length of the scaled-RoPE families and the 24-token window


def hf_model(folder):
    from triforce.model.loading import transformers_model
    return transformers_model(folder, torch.float32)


def greedy(lm, prompt, new_tokens):
    engine = Engine(lm, SpecParams(method="ar"), len(prompt) + new_tokens)
    engine.set_sequence(prompt)
    return engine.generate(new_tokens, SamplingParams()).tokens


def our_logits(lm, ids):
    session = FullTier(lm, len(ids))
    return session.forward(ids)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_logits_match_transformers(tiny_model_dir, family):
    folder = tiny_model_dir(family)
    lm = load_model(str(folder), dtype="float32", device="cpu")
    ref = hf_model(folder)
    ids = torch.randint(3, lm.config.vocab_size, (SEQ_LEN,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0]
    got = our_logits(lm, ids)
    assert (got - expected).abs().max().item() < 1e-4


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_greedy_continuation_matches_transformers(tiny_model_dir, family):
    folder = tiny_model_dir(family)
    lm = load_model(str(folder), dtype="float32", device="cpu")
    ref = hf_model(folder)
    prompt = lm.tokenizer("hello world, this is a test").input_ids
    with torch.no_grad():
        hf_out = ref.generate(torch.tensor([prompt]), max_new_tokens=64, do_sample=False,
                              eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    assert greedy(lm, prompt, 64) == hf_out


def test_default_model_logits_match_transformers(default_lm, default_model_dir):
    ref = hf_model(default_model_dir)
    ids = default_lm.tokenizer("The quick brown fox jumps over the lazy dog. " * 6).input_ids
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0]
    assert (our_logits(default_lm, ids) - expected).abs().max().item() < 1e-4


def test_default_model_greedy_matches_transformers(default_lm, default_model_dir):
    ref = hf_model(default_model_dir)
    prompt = default_lm.tokenizer("Write a short story about a robot who learns to paint.").input_ids
    with torch.no_grad():
        hf_out = ref.generate(torch.tensor([prompt]), max_new_tokens=64, do_sample=False,
                              eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    assert greedy(default_lm, prompt, 64) == hf_out


def test_default_model_says_paris(default_lm):
    prompt = default_lm.tokenizer("The capital of France is").input_ids
    assert "Paris" in default_lm.tokenizer.decode(greedy(default_lm, prompt, 8))


def test_dynamic_rope_past_original_length_matches_transformers(tiny_model_dir):
    folder = tiny_model_dir("llama-dynamic", max_position_embeddings=40)
    lm = load_model(str(folder), dtype="float32", device="cpu")
    ids = torch.randint(3, lm.config.vocab_size, (SEQ_LEN,), generator=torch.Generator().manual_seed(2)).tolist()
    with torch.no_grad():
        expected = hf_model(folder)(torch.tensor([ids])).logits[0]
    assert (our_logits(lm, ids) - expected).abs().max().item() < 1e-4


def test_longrope_takes_its_long_factors_in_every_pass_of_a_long_context_model(tiny_model_dir):
    """transformers picks LongRoPE's factors per pass (long once a pass reaches past the trained 16
    tokens); triforce picks them once from the model's context, so a short first pass already uses
    the long ones: its logits are the first rows of transformers' long pass (attention is causal)."""
    folder = tiny_model_dir("phi3")
    lm = load_model(str(folder), dtype="float32", device="cpu")
    ids = torch.randint(3, lm.config.vocab_size, (SEQ_LEN,), generator=torch.Generator().manual_seed(3)).tolist()
    ref = hf_model(folder)
    with torch.no_grad():
        long_pass = ref(torch.tensor([ids])).logits[0]
        short_pass = ref(torch.tensor([ids[:10]])).logits[0]
    got = our_logits(lm, ids[:10])
    assert (got - long_pass[:10]).abs().max().item() < 1e-4
    assert (got - short_pass).abs().max().item() > 1e-2  # the factors differ: the check above can fail


def test_longrope_within_the_trained_context_takes_the_short_factors(tiny_model_dir):
    folder = tiny_model_dir("phi3", max_position_embeddings=16)  # no extension past the trained 16 tokens
    lm = load_model(str(folder), dtype="float32", device="cpu")
    ids = torch.randint(3, lm.config.vocab_size, (12,), generator=torch.Generator().manual_seed(4)).tolist()
    with torch.no_grad():
        expected = hf_model(folder)(torch.tensor([ids])).logits[0]
    assert (our_logits(lm, ids) - expected).abs().max().item() < 1e-4
