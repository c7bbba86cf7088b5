"""Full-cache bookkeeping on a real (tiny) model: chunked prefill, rollback, prefix reuse, and
AR decoding through the engine."""
import pytest
import torch

from triforce.config import SamplingParams, SpecParams
from triforce.decoding.engine import Engine
from triforce.decoding.full_tier import FullTier
from triforce.errors import UserError
from triforce.model.loading import load_model


@pytest.fixture(scope="module")
def lm(tiny_model_dir):
    return load_model(str(tiny_model_dir("llama-gqa")), dtype="float64", device="cpu")


def ids_of(n, seed=0):
    return torch.randint(3, 40, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_chunked_prefill_equals_one_shot(lm):
    ids = ids_of(50)
    one = FullTier(lm, 64)
    chunked = FullTier(lm, 64)
    assert torch.allclose(one.prefill(ids, chunk=1000), chunked.prefill(ids, chunk=7), atol=1e-10)
    assert torch.allclose(one.cache.keys(1), chunked.cache.keys(1), atol=1e-10)


def test_rollback_then_recompute_gives_same_logits(lm):
    ids = ids_of(30)
    s = FullTier(lm, 40)
    expected = s.prefill(ids)
    s.prefill(ids_of(5, seed=9))  # tokens to be rejected
    s.truncate(29)
    assert torch.allclose(s.prefill(ids[29:]), expected, atol=1e-12)
    assert len(s.tokens) == s.cache.length == 30


def test_cover_reuses_common_prefix(lm):
    s = FullTier(lm, 64)
    first = ids_of(40)
    assert s.cover(first) == (40, None)
    second = first[:35] + ids_of(10, seed=3)
    assert s.cover(second)[0] == 10  # only the tokens after the common prefix are prefilled
    fresh = FullTier(lm, 64)
    fresh.prefill(second)
    assert torch.allclose(s.cache.keys(1), fresh.cache.keys(1), atol=1e-12)
    assert s.cover(second)[0] == 0


def test_recorded_queries_are_reused_on_recover(lm):
    s = FullTier(lm, 64)
    _, first = s.cover(ids_of(20), record_queries=True)
    assert len(first) == lm.config.num_layers and first[0].shape == (1, lm.config.num_heads, 1, lm.config.head_dim)
    prefilled, again = s.cover(ids_of(20), record_queries=True)
    assert prefilled == 0 and again is first
    s.truncate(10)
    prefilled, fresh = s.cover(ids_of(20), record_queries=True)
    assert prefilled == 10 and all(torch.allclose(a, b, atol=1e-12) for a, b in zip(first, fresh))


def test_verify_returns_the_queries_of_every_fed_token(lm):
    s = FullTier(lm, 64)
    ids = ids_of(20)
    s.prefill(ids[:15])
    logits, queries = s.verify(ids, record_queries=True)
    assert logits.shape[0] == 5 and queries[0].shape[2] == 5
    _, last = FullTier(lm, 64).cover(ids, record_queries=True)
    assert all(torch.allclose(q[:, :, -1:], l, atol=1e-12) for q, l in zip(queries, last))


@pytest.mark.parametrize("chunk", [64, 7])  # the window inside the last chunk, and across chunks
def test_a_window_of_queries_is_the_last_tokens_queries(lm, chunk):
    ids = ids_of(40)
    reference = FullTier(lm, 64)
    reference.prefill(ids[:28])
    _, every = reference.verify(ids, record_queries=True)  # queries of tokens 28..39
    s = FullTier(lm, 64, prefill_chunk=chunk)
    _, window = s.cover(ids, record_queries=12)
    assert window[0].shape[2] == 12
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(window, every))
    s.truncate(35)  # 5 new tokens: the window's other 7 are re-run to record their queries
    prefilled, again = s.cover(ids, record_queries=12)
    assert prefilled == 12 and all(torch.allclose(a, b, atol=1e-5) for a, b in zip(again, every))


def generate(lm, prompt, n, params=SamplingParams(), stop=frozenset()):
    engine = Engine(lm, SpecParams(method="ar"), len(prompt) + n)
    engine.set_sequence(prompt)
    return engine.generate(n, params, stop)


def test_decode_stops_at_eos_and_respects_length(lm):
    greedy = generate(lm, ids_of(10), 20)
    assert len(greedy.tokens) == 20 and greedy.stopped_by == "length"
    stop = greedy.tokens[3]
    first_stop = greedy.tokens.index(stop)
    result = generate(lm, ids_of(10), 20, stop=frozenset({stop}))
    assert result.tokens == greedy.tokens[:first_stop + 1] and result.stopped_by == "eos"


def test_decode_stops_when_the_context_is_full(lm):
    engine = Engine(lm, SpecParams(method="triforce", budget=16, chunk_size=4, sink_tokens=4), 14)
    engine.set_sequence(ids_of(10))
    result = engine.generate(50, SamplingParams())
    assert result.stopped_by == "context" and len(engine.seq) == 15


def test_sampling_is_reproducible_with_seed(lm):
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=5)
    assert generate(lm, ids_of(10), 30, params).tokens == generate(lm, ids_of(10), 30, params).tokens


def test_overflowing_the_cache_is_a_clear_error(lm):
    s = FullTier(lm, 16)
    with pytest.raises(UserError, match="does not fit"):
        s.prefill(ids_of(20))
    assert s.cache.length == 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_every_dtype_generates(tiny_model_dir, dtype):
    lm16 = load_model(str(tiny_model_dir("llama-gqa")), dtype=dtype, device="cpu")
    assert lm16.model.lm_head.weight.dtype == lm16.dtype
    assert len(generate(lm16, ids_of(8), 8).tokens) == 8


def test_an_adopted_prefill_decodes_as_its_own(lm):
    """One prefill handed from an AR engine to a triforce engine (bench/vs_transformers.py's method_speed)."""
    ids = ids_of(40, seed=3)
    spec = SpecParams(method="triforce", budget=16, chunk_size=4, gamma1=2, gamma2=4, sink_tokens=4)
    fresh = Engine(lm, spec, 64, "lookup")
    fresh.set_sequence(ids)
    expected = fresh.generate(12, SamplingParams()).tokens

    ar = Engine(lm, SpecParams(method="ar"), 64)
    ar.set_sequence(ids)
    assert ar.generate(12, SamplingParams()).tokens == expected
    shared = Engine(lm, spec, 64, "lookup", kv_cache=ar.full.cache)
    shared.full.adopt(ids[:-1])
    assert shared.set_sequence(ids) == 1  # only the last token runs again, for its queries
    assert shared.generate(12, SamplingParams()).tokens == expected
    with pytest.raises(ValueError, match="the cache holds"):
        FullTier(lm, 64).adopt(ids)
