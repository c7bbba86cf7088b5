"""Offloading with real CUDA streams: pinned host memory, the overlapped copy schedule and the
plain one give the resident cache's tokens. Skipped without CUDA."""
import pytest
import torch

from triforce.config import SamplingParams, SpecParams
from triforce.decoding.engine import Engine
from triforce.model.loading import load_model
from triforce.cache.offloaded import OffloadedKVCache

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

PROMPT = "the cat sat on the mat. the cat sat on the hat. the cat and the dog sat on the log. the cat"


@pytest.fixture(scope="module")
def lm(tiny_model_dir):
    return load_model(str(tiny_model_dir("llama-gqa", max_position_embeddings=512)), dtype="float32",
                      device="cuda")


def run(lm, method, cache=None, new_tokens=30, draft_ahead=False):
    spec = SpecParams(method=method, gamma1=3, gamma2=5, budget=24, chunk_size=4, sink_tokens=4, rebuild_stride=8)
    ids = lm.tokenizer(PROMPT).input_ids
    engine = Engine(lm, spec, len(ids) + new_tokens, "lookup" if spec.uses_draft else None, kv_cache=cache,
                    draft_ahead=draft_ahead)
    engine.set_sequence(ids)
    return engine.generate(new_tokens, SamplingParams())


@pytest.mark.parametrize("method", ["ar", "triforce", "retrieval"])
@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("draft_ahead", [False, True])
def test_cuda_offloaded_equals_resident(lm, method, overlap, draft_ahead):
    """With draft_ahead the speculative methods draft the next cycle during each verify (a worker
    thread verifies while the drafting runs on a stream of its own)."""
    ids = lm.tokenizer(PROMPT).input_ids
    cache = OffloadedKVCache(lm.config, len(ids) + 30, 16, 8, dtype=lm.dtype, device=lm.device, overlap=overlap)
    assert cache.store.pinned
    offloaded = run(lm, method, cache, draft_ahead=draft_ahead)
    assert offloaded.tokens == run(lm, method).tokens
    assert (offloaded.stats.get("draft_ahead_rounds", 0) > 0) == (draft_ahead and method != "ar")
    stats = cache.prefetcher.stats
    assert stats.h2d_bytes > 0 and (stats.hits > 0) == overlap


def test_pinned_copy_bandwidth_is_measurable():
    from triforce.bench.offload_bench import measure_h2d_gbps
    assert measure_h2d_gbps(torch.device("cuda"), 64 << 20) > 1.0


@pytest.mark.parametrize("method,temperature", [("ar", "0"), ("triforce", "0.8")])
def test_host_syncs_stay_within_the_budget_on_cuda(capsys, tiny_model_dir, tmp_path, method, temperature):
    """The simulated card's sync budget (tests/sync_budget.py) on a real GPU, counted by torch's sync
    debug mode: offloaded KV, the hybrid verify, CUDA graphs, sampled verification."""
    from cli_json import run_json
    from sync_budget import PROMPT, allowed_syncs, small_block_profile
    folder = str(tiny_model_dir("llama-gqa", max_position_embeddings=1024, num_layers=4))
    draft = ["--draft", "lookup"] if method == "triforce" else []
    report = run_json(capsys, "generate", "--model", folder, "--prompt", PROMPT, "--device", "cuda", "--max-new-tokens",
                      "16", "--ignore-eos", "--count-syncs", "--json", "--budget", "48", "--chunk-size", "4", "--method",
                      method, *draft, "--dtype", "float32", "--device-budget", "3.0MB", "--profile",
                      small_block_profile(tmp_path), "--temperature", temperature, "--seed", "3")
    assert report["plan"]["offloaded"] and report["plan"]["hybrid"]
    assert all(r["graph_failed"] is None for r in report["graphs"].values()), report["graphs"]
    assert report["host_syncs"]["total"] <= allowed_syncs(report), report["host_syncs"]


def test_the_hybrid_share_follows_the_timed_passes_on_cuda(lm):
    """The hybrid split's tuner on real events (timing events read once done, never waited for):
    passes are timed, the share moves, and the tokens stay the resident cache's."""
    from triforce.offload.hybrid import HybridRates

    ids = lm.tokenizer(PROMPT).input_ids
    rates = HybridRates(h2d_gbps=25.0, cpu_gbps=40.0, cpu_tflops=1.0)
    cache = OffloadedKVCache(lm.config, len(ids) + 30, 16, 8, dtype=lm.dtype, device=lm.device, hybrid=rates)
    tuned = run(lm, "ar", cache)
    torch.cuda.synchronize()
    cache.tuner.share(1)  # what the last pass left to read
    assert tuned.tokens == run(lm, "ar").tokens
    assert cache.tuner.passes > 0 and cache.tuner.shares[1] != rates.cpu_share(1) and cache.cpu_bytes > 0
