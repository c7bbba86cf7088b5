"""Drafting the next cycle during the full verify (triforce.decoding.draft_ahead): every method's
greedy tokens equal AR (float64) in program order and with the verify on a worker thread, over a
resident and an offloaded cache; the drafts are kept in some rounds and dropped in others; it is
off unless asked, and where it cannot run. (Sampling: test_sampling_distribution.)"""
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


def decode(lm, method, ids, draft=None, kv_cache=None, ahead=False, threaded=False):
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
                    engine, got = decode(target, method, ids, draft, ahead=True, threaded=threaded)
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
                _, got = decode(target, method, ids, draft, kv_cache=cache, ahead=True)
                assert got.tokens == expected.tokens, (method, text)
                assert got.stats["draft_ahead_rounds"] > 0 and cache.prefetcher.stats.h2d_bytes > 0


def test_drafting_ahead_only_when_asked_and_possible(models):
    target, _ = models
    tri = Engine(target, tiny_spec("triforce"), 64, "lookup").levels
    ar = Engine(target, tiny_spec("ar"), 64).levels
    assert draft_ahead.wanted(True, tri, False, False)
    assert not draft_ahead.wanted(False, tri, False, False)
    assert not draft_ahead.wanted(True, ar, False, False)  # nothing drafts
    assert not draft_ahead.wanted(True, tri, True, False)  # tensor parallel: collectives from two threads
    assert not draft_ahead.wanted(True, tri, False, True)  # a host-sync count is one thread's
    assert Engine(target, tiny_spec("triforce"), 64, "lookup").ahead is None


def test_generate_draft_ahead_flag_reaches_the_engine(capsys, tiny_model_dir):
    """Through the command users type: --draft-ahead gives the same tokens and reports its rounds."""
    import json

    from triforce.cli.main import main

    model = str(tiny_model_dir("llama-gqa", max_position_embeddings=512))
    outputs = []
    for extra in ([], ["--draft-ahead"]):
        with pytest.raises(SystemExit) as done:
            main(["generate", "--model", model, "--prompt", TINY_PROMPTS[0], "--method", "retrieval", "--budget", "24",
                  "--chunk-size", "4", "--max-new-tokens", "20", "--temperature", "0", "--json", *extra])
        out, err = capsys.readouterr()
        assert done.value.code == 0, err
        outputs.append(json.loads(out))
    assert outputs[0]["tokens"] == outputs[1]["tokens"]
    assert "draft_ahead_rounds" not in json.dumps(outputs[0]) and outputs[1]["draft_ahead_rounds"] > 0
