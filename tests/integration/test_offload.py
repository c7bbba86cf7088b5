"""Offloaded KV on tiny models: every method's greedy tokens equal the fully resident run (float64),
for both copy schedules; layer-major prefill equals token-major; chat keeps working; the
ZeRO-Inference-style baseline decodes the same tokens."""
import pytest
import torch

from triforce.app.chat import Chat
from triforce.bench.offload_peers import HostAttentionKVCache
from triforce.cache.resident import ResidentKVCache
from triforce.config import SamplingParams, SpecParams
from triforce.decoding.engine import Engine
from triforce.model.loading import load_model
from triforce.cache.offloaded import OffloadedKVCache
from test_greedy_equivalence import tiny_spec

GREEDY = SamplingParams()
METHODS = ("ar", "triforce", "retrieval", "streaming", "naive")
PROMPTS = [
    "the cat sat on the mat. the cat sat on the hat. the cat and the dog sat on the log. the cat",
    "one two three four five six seven eight nine ten. one two three four five six seven eight",
    "red green blue red green blue yellow red green blue red green blue yellow red green",
]


spec_for = tiny_spec  # the tiny models' speculation settings


def offloaded(lm, max_len, overlap=True, resident=16, block=8, decode_resident=0):
    return OffloadedKVCache(lm.config, max_len, resident, block, dtype=lm.dtype, device=lm.device,
                            overlap=overlap, pin=False, decode_resident_tokens=decode_resident)


def decode(lm, spec, ids, new_tokens, draft=None, kv_cache=None):
    engine = Engine(lm, spec, len(ids) + new_tokens, draft, kv_cache=kv_cache)
    engine.set_sequence(ids)
    return engine.generate(new_tokens, GREEDY)


@pytest.fixture(scope="module", params=["llama-gqa", "mistral"])
def models(request, tiny_model_dir):
    target = load_model(str(tiny_model_dir(request.param, max_position_embeddings=512)), dtype="float64",
                        device="cpu")
    draft = load_model(str(tiny_model_dir("llama-gqa", seed=7, num_layers=1, hidden_size=32,
                                          max_position_embeddings=512)), dtype="float64", device="cpu")
    return target, draft


@pytest.mark.parametrize("overlap,decode_resident", [(True, 0), (False, 0), (True, 40)],
                         ids=["overlapped", "plain", "blocks-moved-after-prefill"])
def test_every_method_offloaded_equals_resident(models, overlap, decode_resident):
    target, draft_model = models
    for i, text in enumerate(PROMPTS):
        ids = target.tokenizer(text).input_ids
        for method in METHODS:
            draft = (draft_model if i % 2 else "lookup") if spec_for(method).uses_draft else None
            expected = decode(target, spec_for(method), ids, 30, draft)
            cache = offloaded(target, len(ids) + 30, overlap, decode_resident=decode_resident)
            got = decode(target, spec_for(method), ids, 30, draft, kv_cache=cache)
            assert got.tokens == expected.tokens, (method, text)
            assert cache.ext_tokens > 0 if decode_resident else cache.k_ext is None
            assert got.stats["mean_tokens_per_full_verify"] == expected.stats["mean_tokens_per_full_verify"]
            assert cache.prefetcher.stats.h2d_bytes > 0


@pytest.mark.parametrize("group", [13, 26, 1000])
def test_layer_major_forward_equals_token_major(models, group):
    target, _ = models
    ids = torch.tensor([target.tokenizer(PROMPTS[0]).input_ids])
    positions = torch.arange(ids.shape[1])[None]
    one = ResidentKVCache(target.config, 200, dtype=target.dtype)
    other = ResidentKVCache(target.config, 200, dtype=target.dtype)
    expected = target.model(ids, positions, one.step(ids.shape[1]))[:, -1:]
    got = target.model(ids, positions, other.step(ids.shape[1]), num_logits=1, chunk_tokens=13, group_tokens=group)
    assert torch.allclose(got, expected, atol=1e-10)
    assert torch.allclose(one.keys(1), other.keys(1), atol=1e-12)


def test_layer_major_prefill_streams_old_host_kv_once_per_query_group(models):
    """A second prompt after a first one whose KV went to the host: each attention call of a
    layer streams the old host blocks once, so the prefill's copies scale with the number of
    query groups, not of prefill chunks; the logits do not change."""
    from triforce.decoding.full_tier import FullTier

    target, _ = models
    ids = target.tokenizer(" ".join(PROMPTS) * 2).input_ids
    first, second = ids[:len(ids) // 2], ids[len(ids) // 2:]
    results = {}
    for group in (8, 64, 4096):
        cache = offloaded(target, len(ids) + 8)
        full = FullTier(target, len(ids) + 8, cache, prefill_chunk=8, prefill_group=group)
        full.prefill(first)
        before = cache.prefetcher.stats.h2d_bytes
        results[group] = full.prefill(second), cache.prefetcher.stats.h2d_bytes - before
    reference = FullTier(target, len(ids) + 8)
    reference.prefill(first)
    expected = reference.prefill(second)
    groups = {g: -(-len(second) // g) for g in results}
    per_group = results[4096][1]
    assert groups[4096] == 1 and per_group > 0
    for group, (logits, copied) in results.items():
        assert torch.allclose(logits, expected, atol=1e-10)
        assert copied == groups[group] * per_group


def test_chat_turns_with_offloaded_kv_match_resident(models):
    target, _ = models
    answers = []
    for cache in (None, offloaded(target, 400)):
        chat = Chat(target, 400, spec=spec_for("triforce"), draft="lookup", kv_cache=cache)
        first = chat.ask("the cat sat on the mat. the cat", GREEDY, 20)
        first_turn = chat.last_prefill_tokens
        second = chat.ask("the dog sat on the log. the dog", GREEDY, 20)
        assert chat.last_prefill_tokens <= len(chat.full.tokens) - first_turn  # the first turn was kept
        answers.append((first.tokens, second.tokens))
    assert answers[0] == answers[1]


def test_zero_inference_baseline_decodes_the_same_tokens(models):
    target, _ = models
    ids = target.tokenizer(PROMPTS[1]).input_ids
    expected = decode(target, SpecParams(), ids, 20)
    cache = HostAttentionKVCache(target.config, len(ids) + 20, dtype=target.dtype, device=target.device)
    got = decode(target, SpecParams(), ids, 20, kv_cache=cache)
    assert got.tokens == expected.tokens and cache.d2h_bytes > 0
