"""Memory: what the planner budgets is what the runtime allocates, category by category; the
automatic profile of a (simulated) 24 GB card fits Llama-3.1-8B bf16 at 32K whether it is read
before or after the model is loaded; pinned bytes equal the planned host bytes."""
import pytest
import torch

from triforce.app.plan_and_cache import auto_profile, build_kv_cache, make_plan
from triforce.config import SamplingParams, SpecParams
from triforce.config.model import ModelConfig
from triforce.decoding.engine import Engine
from triforce.decoding.tiers import DraftModelTier, SparseTier
from triforce.model.architectures import arch_hf_config
from triforce.model.loading import load_model, resolve_device
from triforce.plan.profiles import load_profile
from triforce.pinned import pinned_bytes

from fake_card import FakeCard

GIB = 2**30


def simulated_card(monkeypatch, total: int, ours: int, others: int = 600 << 20) -> torch.device:
    """A CUDA card of `total` bytes where this process's PyTorch holds `ours` (loaded weights)
    and the CUDA context and other programs `others`; returns the device `--device cuda` means
    (what the runtime passes, resolved as a user's flag is)."""
    FakeCard(total_bytes=total, ours_bytes=ours, others_bytes=others).install(monkeypatch)
    return resolve_device("cuda")


def llama31_8b_plan(profile, context=32768):
    cfg = ModelConfig.from_hf(arch_hf_config("llama3.1-8b"))
    return make_plan(cfg, profile, context, SpecParams(method="ar"), torch.bfloat16)


@pytest.mark.parametrize("loaded", [False, True], ids=["before-loading", "after-loading"])
def test_auto_profile_of_a_24gb_card_fits_llama31_8b_bf16_at_32k(monkeypatch, loaded):
    weights = 16_060_522_496  # Llama-3.1-8B in bf16, already on the card after loading
    device = simulated_card(monkeypatch, total=24564 << 20, ours=weights if loaded else 0)
    plan = llama31_8b_plan(auto_profile(device))
    assert plan.feasible, plan.reason
    assert plan.breakdown["target_weights"] == pytest.approx(weights, rel=0.01)


def test_auto_profile_is_the_same_before_and_after_loading(monkeypatch):
    device = simulated_card(monkeypatch, total=32 * 10**9, ours=0)
    before = llama31_8b_plan(auto_profile(device), 130000)
    device = simulated_card(monkeypatch, total=32 * 10**9, ours=16 * 10**9)
    after = llama31_8b_plan(auto_profile(device), 130000)
    assert before.feasible and before.offloaded and before.resident_tokens == after.resident_tokens > 0


def test_planned_bytes_equal_allocated_bytes(tiny_model_dir, pinning):
    lm = load_model(str(tiny_model_dir("llama-gqa", max_position_embeddings=1024)), dtype="float32", device="cpu")
    draft = load_model(str(tiny_model_dir("llama-gqa", seed=7, num_layers=1, hidden_size=32)), dtype="float32",
                       device="cpu")
    spec = SpecParams(method="triforce", gamma1=3, gamma2=5, budget=64, chunk_size=8, sink_tokens=8)
    ids = lm.tokenizer("the cat sat on the mat. " * 20).input_ids
    max_len = len(ids) + 40
    profile = load_profile("cpu").with_device_budget(2_400_000)
    plan = make_plan(lm.config, profile, max_len, spec, lm.dtype, draft.config, draft.dtype)
    assert plan.feasible and 0 < plan.resident_tokens < max_len, plan.reason
    pinned_before = pinned_bytes()
    cache = build_kv_cache(lm, max_len, plan)
    engine = Engine(lm, spec, max_len, draft, kv_cache=cache, prefill_chunk=plan.prefill_chunk)
    engine.set_sequence(ids)
    engine.generate(20, SamplingParams())
    (tier0,) = [t for t in engine.levels if isinstance(t, DraftModelTier)]
    (tier1,) = [t for t in engine.levels if isinstance(t, SparseTier)]

    def params(model):
        return sum(p.numel() * p.element_size() for p in model.parameters())

    b = plan.breakdown
    assert params(lm.model) == b["target_weights"]
    assert params(draft.model) == b["draft_weights"]
    assert tier1.cache.k_buf.nbytes + tier1.cache.v_buf.nbytes == b["retrieval_cache"]
    assert tier0.cache.k_buf.nbytes + tier0.cache.v_buf.nbytes == b["streaming_cache"]
    assert cache.k_res.nbytes + cache.v_res.nbytes == b["resident_kv"]
    # blocks moved to the device after prefill: the plan's count, within the prefill's scratch
    per_token = 2 * lm.config.num_layers * lm.config.num_kv_heads * lm.config.head_dim * 4
    assert cache.ext_capacity == plan.decode_resident_tokens - plan.resident_tokens
    if cache.k_ext is not None:
        assert cache.k_ext.nbytes + cache.v_ext.nbytes == cache.ext_capacity * per_token <= b["prefill_scratch"]
    assert cache.prefetcher.staging_bytes == b["staging_buffers"]
    means = sum(m.nbytes for m in cache._resident_means.values())
    assert means == b["chunk_means"]
    assert cache.store.nbytes == plan.host_breakdown["host_kv"]
    gather_staging = sum(t.nbytes for t in cache._gather_staging)
    token_row = 2 * lm.config.num_kv_heads * lm.config.head_dim * 4  # one token's K and V in one layer
    # budget vs selected slots, in each layer of the rebuild's one group (offload.shapes.gather_staging_bytes)
    assert 0 <= plan.host_breakdown["host_staging"] - gather_staging <= token_row * lm.config.num_layers
    host_means = sum(m.nbytes for m in cache._host_means.values())  # pinned: copied to and from the card
    assert host_means == plan.host_breakdown["host_chunk_means"]
    # what is pinned is what was asked for: no power-of-two rounding
    assert pinned_bytes() - pinned_before == cache.store.nbytes + gather_staging + host_means


@pytest.mark.parametrize("command", [["generate", "--prompt", "hi"], ["chat"]])
def test_a_context_the_desktop_cannot_hold_is_refused_before_loading(capsys, monkeypatch, tmp_path, card, command):
    """Issue 74: Llama-2-7B at 127K on a 24 GB card wants 58 GiB of host KV even decoding plainly
    (auto's least); a 64 GB desktop gives 53.64. The run says so before it reads a weight (this
    folder has none: a load would fail another way), with the longest context that fits."""
    import json

    from triforce.cli.main import main
    from triforce.plan import host_limits

    folder = tmp_path / "llama2-7b-128k"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(arch_hf_config("llama2-7b-128k").to_dict()))
    desktop = host_limits.HostMemory(64 * 10**9, 64 * 10**9, "this machine")
    monkeypatch.setattr(host_limits, "host_memory", lambda override=None: desktop)
    with pytest.raises(SystemExit) as exit_info:
        main([*command, "--model", str(folder), "--device", "cuda", "--profile", "rtx4090-24g", "--max-context", "130048"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code != 0 and len(lines) == 1 and lines[0].startswith("triforce: error: "), lines
    for fragment in ("a 130048-token context does not fit here (nothing was loaded)",
                     "58.00 GiB of host memory but 53.64 GiB is usable", "about 120832 tokens"):
        assert fragment in lines[0], lines[0]
