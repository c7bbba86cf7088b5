"""Lossless at temperature 0: every method's tokens equal plain AR greedy decoding (float64)."""
import pytest

from triforce.app.texts import stdlib_prose
from triforce.config import SamplingParams, SpecParams
from triforce.decoding.engine import Engine
from triforce.model.loading import load_model
from tiny_models import make_tiny_model

GREEDY = SamplingParams()
SPECULATIVE = ("triforce", "retrieval", "streaming", "snapkv", "naive")

TINY_PROMPTS = [
    "the cat sat on the mat. the cat sat on the hat. the cat",
    "abc abc abc abd abc abe abc",
    "one two three four five six seven eight nine ten one two three",
    "hello world, hello there, hello again, hello",
    "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16",
    "a quick brown fox jumps over the lazy dog. a quick brown",
    "to be or not to be, that is the question. to be",
    "zzzz yyyy xxxx wwww zzzz yyyy",
    "the rain in spain stays mainly in the plain. the rain",
    "red green blue red green blue red green",
    "lorem ipsum dolor sit amet, consectetur adipiscing elit. lorem",
    "if it is to be, it is up to me. if it",
    "north south east west north south",
    "she sells sea shells by the sea shore. she sells",
    "bits and bytes and bits and bytes and",
    "0101 0110 0111 1000 0101 0110",
    "the end is the beginning is the end is the",
    "row row row your boat gently down the stream. row row",
    "why? because! why? because! why?",
    "mary had a little lamb, little lamb, little lamb, mary had",
    "kiwi mango kiwi papaya kiwi mango kiwi",
]


def tiny_spec(method):
    return SpecParams(method=method, gamma1=3, gamma2=5, budget=24, chunk_size=4, sink_tokens=4,
                      rebuild_stride=8, draft_window=16, snapkv_window=4)


def run(lm, spec, ids, new_tokens, draft=None, params=GREEDY):
    engine = Engine(lm, spec, len(ids) + new_tokens, draft)
    engine.set_sequence(ids)
    return engine.generate(new_tokens, params).tokens


@pytest.fixture(scope="module", params=["llama-mha", "llama-gqa", "qwen3", "phi3", "phi4-mini"])
def tiny_pair(request, tiny_model_dir):
    target = load_model(str(tiny_model_dir(request.param)), dtype="float64", device="cpu")
    draft = load_model(str(tiny_model_dir("llama-gqa", seed=7, num_layers=1, hidden_size=32)),
                       dtype="float64", device="cpu")
    return target, draft


@pytest.mark.parametrize("drafter", ["lookup", "model"])
def test_tiny_models_every_method_equals_ar(tiny_pair, drafter):
    target, draft_model = tiny_pair
    draft = draft_model if drafter == "model" else "lookup"
    assert len(TINY_PROMPTS) >= 20
    for text in TINY_PROMPTS:
        ids = target.tokenizer(text).input_ids
        expected = run(target, SpecParams(method="ar"), ids, 40)
        for method in SPECULATIVE:
            got = run(target, tiny_spec(method), ids, 40, draft)
            assert got == expected, (method, text)


def test_greedy_with_penalties_every_method_equals_ar(tiny_pair):
    """Penalties change the argmax itself: every tier takes it with its own context's penalties."""
    target, draft_model = tiny_pair
    penalized = SamplingParams(repeat_penalty=1.3, presence_penalty=0.2, frequency_penalty=0.1, penalty_last_n=16)
    changed = 0
    for text in TINY_PROMPTS[:8]:
        ids = target.tokenizer(text).input_ids
        expected = run(target, SpecParams(method="ar"), ids, 30, params=penalized)
        changed += expected != run(target, SpecParams(method="ar"), ids, 30)
        for method in SPECULATIVE:
            for draft in ("lookup", draft_model):
                assert run(target, tiny_spec(method), ids, 30, draft, penalized) == expected, (method, text)
    assert changed >= 4  # the penalties do change what greedy decoding picks


def test_triforce_with_two_tiers_equals_ar(tiny_pair):
    target, _ = tiny_pair
    for text in TINY_PROMPTS[:5]:
        ids = target.tokenizer(text).input_ids
        assert run(target, tiny_spec("triforce"), ids, 30, "none") == run(target, SpecParams(), ids, 30)


@pytest.fixture(scope="module")
def default_lm64(default_model_dir):
    return load_model(str(default_model_dir), dtype="float64", device="cpu")


@pytest.fixture(scope="module")
def default_draft64(default_model_dir, tmp_path_factory):
    """A tiny random model with SmolLM2's tokenizer: poor drafts, but a real model drafter."""
    folder = make_tiny_model(tmp_path_factory.mktemp("smol-draft"), "llama-gqa", seed=3, num_layers=1,
                             hidden_size=32, max_position_embeddings=8192, tokenizer=default_model_dir)
    return load_model(str(folder), dtype="float64", device="cpu")


def default_prompts(tokenizer, count=20, length=128):
    words = stdlib_prose().split()
    prompts = []
    for i in range(count):
        chunk = " ".join(words[i * 97:i * 97 + length // 2])
        prompts.append(tokenizer(chunk + " " + chunk[:200]).input_ids[:length])
    return prompts


@pytest.mark.slow
def test_default_model_every_method_equals_ar(default_lm64, default_draft64):
    spec = dict(gamma1=3, gamma2=6, budget=48, chunk_size=8, sink_tokens=8, rebuild_stride=6)
    # 2 prompts in float64 (the 20-prompt sweeps run on the tiny models above): every method, each
    # drafter once for naive and triforce (8 prompts took 66 s of the suite, 20 took ~4 minutes)
    for i, ids in enumerate(default_prompts(default_lm64.tokenizer, count=2)):
        expected = run(default_lm64, SpecParams(), ids, 10)
        for method in SPECULATIVE:
            draft = default_draft64 if (method, i) in (("triforce", 0), ("naive", 1)) else "lookup"
            got = run(default_lm64, SpecParams(method=method, **spec), ids, 10, draft)
            assert got == expected, (method, i)


@pytest.mark.parametrize("family", ["llama3.2", "mistral-small"])
def test_newer_families_every_method_equals_ar(tiny_model_dir, family):
    """Llama 3.2 (tied embeddings, Llama 3 rope scaling) and Mistral Small 3.x (no window, heads
    narrower than hidden / heads): every method, prompt lookup drafting, float64."""
    target = load_model(str(tiny_model_dir(family)), dtype="float64", device="cpu")
    for text in TINY_PROMPTS[:4]:
        ids = target.tokenizer(text).input_ids
        expected = run(target, SpecParams(method="ar"), ids, 30)
        for method in SPECULATIVE:
            assert run(target, tiny_spec(method), ids, 30, "lookup") == expected, (family, method, text)


def test_gemma3_every_method_equals_ar_with_a_gemma_drafter(tiny_model_dir):
    """Gemma 3: windowed and global layers with their own RoPE, past the 12-token window in every
    prompt; a two-layer Gemma drafter, whose StreamingLLM cache turns each kind of layer's keys
    with that layer's RoPE when its window slides. Every method, both drafters, float64."""
    target = load_model(str(tiny_model_dir("gemma3")), dtype="float64", device="cpu")
    draft = load_model(str(tiny_model_dir("gemma3", seed=5, hidden_size=32)), dtype="float64", device="cpu")
    assert len({id(r) for r in draft.model.layer_ropes}) == 2
    distinct = 0
    for text in TINY_PROMPTS[:6]:
        ids = target.tokenizer(text).input_ids
        expected = run(target, SpecParams(method="ar"), ids, 30)
        distinct += len(set(expected))
        for method in SPECULATIVE:
            for drafter in ("lookup", draft):
                assert run(target, tiny_spec(method), ids, 30, drafter) == expected, (method, text)
    assert distinct >= 24  # continuations that vary (one token repeated would make every method agree)
