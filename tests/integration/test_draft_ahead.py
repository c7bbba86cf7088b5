"""Drafting the next cycle during the full verify (triforce.decoding.draft_ahead): every method's
greedy tokens equal AR (float64) in program order and with the verify on a worker thread, over a
resident and an offloaded cache; the drafts are kept in some rounds and dropped in others; auto
turns it on only where a verify waits on copies. (Sampling: test_sampling_distribution.)"""
import threading

import pytest

from triforce.config import SamplingParams
from triforce.decoding import draft_ahead
from triforce.decoding.draft_ahead import AheadRunner
from triforce.decoding.engine import Engine
from triforce.decoding.full_tier import FullTier
from triforce.model.loading import load_model
from test_greedy_equivalence import TINY_PROMPTS, tiny_spec
from test_offload import offloaded

GREEDY = SamplingParams()
METHODS = ("triforce", "retrieval", "streaming", "snapkv", "naive")
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def models(tiny_model_dir):
    target = load_model(str(tiny_model_dir("llama-gqa", max_position_embeddings=512)), dtype="float64", device="cpu")
    draft = load_model(str(tiny_model_dir("llama-gqa", seed=7, num_layers=1, hidden_size=32,
                                          max_position_embeddings=512)), dtype="float64", device="cpu")
    return target, draft


def decode(lm, method, ids, draft=None, kv_cache=None, ahead="off", threaded=False):
    engine = Engine(lm, tiny_spec(method), len(ids) + NEW_TOKENS, draft, kv_cache=kv_cache, draft_ahead=ahead)
    if threaded:
        engine.ahead = AheadRunner(lm.device, threaded=True)
    engine.set_sequence(ids)
    return engine, engine.generate(NEW_TOKENS, GREEDY)


def drafters(method, draft_model):
    return [draft_model, "lookup"] if tiny_spec(method).uses_draft else [None]


@pytest.mark.parametrize("threaded", [False, True], ids=["in-turn", "verify-on-a-thread"])
def test_every_method_drafting_ahead_equals_ar(models, threaded):
    target, draft_model = models
    verify_threads = set()
    real_verify = FullTier.verify

    def verify(self, *args, **kwargs):
        verify_threads.add(threading.current_thread().name)
        return real_verify(self, *args, **kwargs)

    rounds = kept = 0
    FullTier.verify = verify
    try:
        for text in TINY_PROMPTS[:8]:
            ids = target.tokenizer(text).input_ids
            expected = decode(target, "ar", ids)[1].tokens
            for method in METHODS:
                for draft in drafters(method, draft_model):
                    engine, got = decode(target, method, ids, draft, ahead="on", threaded=threaded)
                    assert got.tokens == expected, (method, text, draft)
                    rounds += got.stats["draft_ahead_rounds"]
                    kept += got.stats["draft_ahead_kept"]
    finally:
        FullTier.verify = real_verify
    assert 0 < kept < rounds  # both branches ran: drafts kept and drafts dropped
    assert any(name.startswith("full-verify") for name in verify_threads) == threaded


def test_offloaded_cache_drafting_ahead_equals_resident(models):
    target, draft_model = models
    for text in TINY_PROMPTS[8:14]:
        ids = target.tokenizer(text).input_ids
        for method in ("triforce", "retrieval"):
            for draft in drafters(method, draft_model):
                expected = decode(target, method, ids, draft)[1]
                cache = offloaded(target, len(ids) + NEW_TOKENS)
                _, got = decode(target, method, ids, draft, kv_cache=cache, ahead="on")
                assert got.tokens == expected.tokens, (method, text)
                assert got.stats["draft_ahead_rounds"] > 0 and cache.prefetcher.stats.h2d_bytes > 0


def test_auto_drafts_ahead_only_where_a_verify_waits_on_copies(models):
    target, draft_model = models

    class Copying:
        copy_bound = True

    class Resident:
        copy_bound = False

    def levels(method, draft):
        engine = Engine(target, tiny_spec(method), 64, draft)
        return engine.levels

    tri, ar, lookup_only = levels("triforce", "lookup"), levels("ar", None), levels("naive", "lookup")
    assert draft_ahead.wanted("auto", tri, Copying(), False, False)
    assert not draft_ahead.wanted("auto", tri, Resident(), False, False)
    assert not draft_ahead.wanted("auto", ar, Copying(), False, False)  # nothing drafts
    assert not draft_ahead.wanted("auto", lookup_only, Copying(), False, False)  # a lookup costs nothing to redo
    assert draft_ahead.wanted("on", lookup_only, Resident(), False, False)
    assert not draft_ahead.wanted("on", tri, Copying(), True, False)  # tensor parallel: one thread's collectives
    assert not draft_ahead.wanted("on", tri, Copying(), False, True)  # counting syncs
    assert not draft_ahead.wanted("off", tri, Copying(), False, False)
    with pytest.raises(ValueError, match="draft_ahead must be one of"):
        draft_ahead.wanted("yes", tri, Copying(), False, False)
    assert Engine(target, tiny_spec("triforce"), 64, "lookup").ahead is None  # resident on a CPU: auto is off
