"""Cache bookkeeping on a real (tiny) model: chunked prefill, rollback, prefix reuse."""
import pytest
import torch

from triforce.config import SamplingParams
from triforce.errors import UserError
from triforce.loading import load_model
from triforce.session import Session


@pytest.fixture(scope="module")
def lm(tiny_model_dir):
    return load_model(str(tiny_model_dir("llama-gqa")), dtype="float64", device="cpu")


def ids_of(n, seed=0):
    return torch.randint(3, 40, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_chunked_prefill_equals_one_shot(lm):
    ids = ids_of(50)
    one = Session(lm, 64)
    one.prefill(ids, chunk=1000)
    chunked = Session(lm, 64)
    chunked.prefill(ids, chunk=7)
    assert torch.allclose(one.last_logits, chunked.last_logits, atol=1e-10)
    assert torch.allclose(one.cache.keys(1), chunked.cache.keys(1), atol=1e-10)


def test_rollback_then_recompute_gives_same_logits(lm):
    ids = ids_of(30)
    s = Session(lm, 40)
    s.prefill(ids)
    expected = s.last_logits.clone()
    s.prefill(ids_of(5, seed=9))  # tokens to be rejected
    s.truncate(29)
    s.prefill(ids[29:])
    assert torch.allclose(s.last_logits, expected, atol=1e-12)
    assert len(s.tokens) == s.cache.length == 30


def test_sync_to_reuses_common_prefix(lm):
    s = Session(lm, 64)
    first = ids_of(40)
    assert s.sync_to(first) == 40
    second = first[:35] + ids_of(10, seed=3)
    assert s.sync_to(second) == 10  # only the tokens after the common prefix are prefilled
    fresh = Session(lm, 64)
    fresh.prefill(second)
    assert torch.allclose(s.last_logits, fresh.last_logits, atol=1e-12)
    assert s.sync_to(second) == 0


def test_decode_stops_at_eos_and_respects_length(lm):
    s = Session(lm, 64)
    s.prefill(ids_of(10))
    greedy = s.decode_ar(20, SamplingParams(), frozenset())
    assert len(greedy.tokens) == 20 and greedy.stopped_by == "length"
    s2 = Session(lm, 64)
    s2.prefill(ids_of(10))
    stop = greedy.tokens[3]
    first_stop = greedy.tokens.index(stop)
    result = s2.decode_ar(20, SamplingParams(), frozenset({stop}))
    assert result.tokens == greedy.tokens[:first_stop + 1] and result.stopped_by == "eos"


def test_sampling_is_reproducible_with_seed(lm):
    def run():
        s = Session(lm, 64)
        s.prefill(ids_of(10))
        return s.decode_ar(30, SamplingParams(temperature=0.8, top_p=0.9, seed=5), frozenset()).tokens
    assert run() == run()


def test_overflowing_the_cache_is_a_clear_error(lm):
    s = Session(lm, 16)
    with pytest.raises(UserError, match="does not fit"):
        s.prefill(ids_of(20))
    assert s.cache.length == 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_every_dtype_generates(tiny_model_dir, dtype):
    lm16 = load_model(str(tiny_model_dir("llama-gqa")), dtype=dtype, device="cpu")
    assert lm16.model.lm_head.weight.dtype == lm16.dtype
    s = Session(lm16, 32)
    s.prefill(ids_of(8))
    assert len(s.decode_ar(8, SamplingParams(), frozenset()).tokens) == 8
