"""The memory planner and its cost model: pure arithmetic checked against hand computations."""
import pytest

from triforce.config import SpecParams
from triforce.model.architectures import arch_config
from triforce.plan.cost_model import (GAMMA2_RANGE, TIE_FRACTION, Acceptance, Gamma1Controller, Gamma2Controller,
                                      Hardware, StepCosts, best_gammas,
                                      expected_tokens, full_verify_ms, gamma2_bounds, tier0_ms, tier1_ms,
                                      rate_from_fraction, static_tree_part, triforce_ms_per_token)
from triforce.offload.errors import OffloadError
from triforce.plan.planner import plan_memory
from triforce.plan.profiles import load_profile
from triforce.offload.shapes import activation_bytes_per_token, kv_bytes_per_token_layer, weight_bytes

GiB = 2**30
TRIFORCE = SpecParams(method="triforce", budget=4096, gamma1=2, gamma2=6)


def plan(arch, profile, context=130048, tp=1, spec=TRIFORCE, draft="llama-68m", **kw):
    return plan_memory(arch_config(arch), load_profile(profile), context, spec, dtype_bytes=2,
                       draft=arch_config(draft) if draft else None, tp=tp, **kw)


def test_llama2_7b_128k_fits_one_4090_with_most_kv_on_the_host():
    p = plan("llama2-7b-128k", "rtx4090-24g")
    assert p.feasible and p.offloaded
    assert p.host_kv_bytes >= 40 * GiB
    assert p.gpu_bytes_total <= p.gpu_budget_bytes
    assert p.resident_tokens % 256 == 0 and p.resident_tokens > 0
    # the KV of every token is somewhere, exactly once; the host store holds whole blocks
    per_token = kv_bytes_per_token_layer(arch_config("llama2-7b-128k"), 2) * 32
    rounding = p.resident_kv_bytes + p.host_kv_bytes - 130048 * per_token
    assert 0 <= rounding < p.block_tokens * per_token


def test_llama2_13b_128k_needs_two_cards():
    one = plan("llama2-13b-128k", "rtx4090-24g")
    assert not one.feasible and "--tp 2" in one.reason
    two = plan("llama2-13b-128k", "2x-rtx4090-24g", tp=2)
    assert two.feasible and two.gpu_bytes_total <= two.gpu_budget_bytes


@pytest.mark.parametrize("arch,profile,tp", [
    ("llama2-7b-128k", "rtx4090-24g", 1), ("llama2-13b-128k", "2x-rtx4090-24g", 2),
    ("lwm-text-chat-128k", "rtx3090-24g", 1), ("llama3.1-8b", "rtx4080-16g", 1), ("llama3.1-8b", "h100-80g", 1),
    ("smollm2-135m", "cpu", 1),
])
def test_planned_categories_equal_what_the_runtime_allocates(arch, profile, tp):
    """Real architectures built on the meta device (no memory): the weights of the rank's share,
    the draft, the retrieval, streaming and resident caches take exactly the planned bytes."""
    import torch

    from triforce.cache.resident import ResidentKVCache
    from triforce.cache.sparse import SelectionPolicy, SparseKVCache
    from triforce.cache.streaming import StreamingKVCache
    from triforce.model.architectures import arch_hf_config
    from triforce.model.decoder import CausalLM
    from triforce.model.rope import RotaryEmbedding
    from triforce.model.tensor_parallel import shard_meta_model

    def meta_model(name, share=None):
        rope = RotaryEmbedding(arch_hf_config(name))
        with torch.device("meta"):
            model = CausalLM(arch_config(name), rope).to(torch.bfloat16)
        model.tie_weights()
        if share is not None:
            shard_meta_model(model, *share)
        return model

    p = plan(arch, profile, tp=tp)
    b = p.breakdown
    target = meta_model(arch, (0, tp) if tp > 1 else None)
    draft = meta_model("llama-68m")
    assert sum(x.numel() * x.element_size() for x in target.parameters()) == b["target_weights"]
    assert sum(x.numel() * x.element_size() for x in draft.parameters()) == b["draft_weights"]
    meta = dict(dtype=torch.bfloat16, device="meta")
    sparse = SparseKVCache(target.config, SelectionPolicy("retrieval", TRIFORCE.budget, TRIFORCE.chunk_size),
                           TRIFORCE.sparse_append_slots, **meta)
    assert sparse.k_buf.nbytes + sparse.v_buf.nbytes == b["retrieval_cache"]
    streaming = StreamingKVCache(draft.config, None, TRIFORCE.sink_tokens, TRIFORCE.draft_window_tokens,
                                 TRIFORCE.draft_slack, **meta)
    assert streaming.k_buf.nbytes + streaming.v_buf.nbytes == b["streaming_cache"]
    resident = ResidentKVCache(target.config, p.resident_tokens, **meta)
    assert resident.k_buf.nbytes + resident.v_buf.nbytes == b["resident_kv"]
    assert p.feasible == (sum(b.values()) <= p.gpu_budget_bytes and p.host_bytes_total <= load_profile(profile).host_bytes)


def test_weight_bytes_by_hand():
    cfg = arch_config("llama2-7b-128k")
    per_layer = 4 * 4096 * 4096 + 3 * 4096 * 11008 + 2 * 4096
    assert weight_bytes(cfg, 2) == 2 * (32 * per_layer + 2 * 32000 * 4096 + 4096)
    # tensor parallelism splits attention by whole heads and the MLP by rows; embeddings stay whole
    half = 4 * 4096 * 2048 + 3 * 4096 * 5504 + 2 * 4096
    assert weight_bytes(cfg, 2, tp=2) == 2 * (32 * half + 2 * 32000 * 4096 + 4096)


def test_a_resident_plan_holds_the_full_tier_s_graphs_by_hand():
    """Issue 73: the full tier's verify widths 1..7 (gamma2 6) each keep a graph with its [T, vocab]
    logits and every layer's queries of T tokens (the retrieval tier reads them)."""
    with_graphs = plan("llama3.1-8b", "rtx4090-24g", context=8192, draft=None, graphs=True)
    without = plan("llama3.1-8b", "rtx4090-24g", context=8192, draft=None, graphs=False)
    assert with_graphs.resident_tokens == 8192
    rows = 7 * 8 // 2
    full = rows * (128256 + 32 * 32 * 128) * 2 + 7 * (6 * 4096 + 2 * 32 * 128 + 3 * 14336) * 2
    sparse = rows * 128256 * 2 + 7 * (6 * 4096 + 2 * 32 * 128 + 3 * 14336) * 2
    assert with_graphs.breakdown["cuda_graph_pool"] == full + sparse
    assert without.breakdown["cuda_graph_pool"] == 0
    # a sliding-window model's full tier runs eagerly: only its sparse tier's graphs
    gemma = plan("gemma3-27b", "h100-80g", context=8192, draft=None, graphs=True)
    cfg = arch_config("gemma3-27b")
    assert gemma.resident_tokens == 8192
    assert gemma.breakdown["cuda_graph_pool"] == rows * cfg.vocab_size * 2 + 7 * activation_bytes_per_token(cfg, 2)


def test_block_quantized_weight_bytes_by_hand():
    """Matrices at the format's bytes per weight as the kernels hold them (q4_k: 144 per 256 in a
    file, 152 per 256 as the GPU's hold it: 128 of nibbles, 8 sc, 8 m, float32 d and dmin; 24 per
    32 as the CPU's, scales expanded to float32); the norms stay in the dtype."""
    from triforce.offload.shapes import block_bytes_per_weight
    cfg = arch_config("llama2-7b-128k")
    matrices = 32 * (4 * 4096 * 4096 + 3 * 4096 * 11008) + 2 * 32000 * 4096
    norms = 32 * 2 * 4096 + 4096
    assert block_bytes_per_weight("q4_k", on_gpu=True) == (128 + 8 + 8 + 8) / 256
    assert block_bytes_per_weight("q4_1", on_gpu=True) == 20 / 32  # the file's float16 d and m
    assert block_bytes_per_weight("q4_k", on_gpu=False) == 24 / 32 and block_bytes_per_weight(None, True) is None
    assert weight_bytes(cfg, 2, matrix_bytes=144 / 256) == matrices * 144 // 256 + 2 * norms
    with pytest.raises(OffloadError, match="unknown weight format"):
        block_bytes_per_weight("q3_k", on_gpu=True)


def test_uneven_kv_head_split_plans_for_the_larger_share():
    cfg = arch_config("smollm2-135m")  # 3 KV heads: 2 + 1 over two ranks
    assert kv_bytes_per_token_layer(cfg, 4, tp=2) == 2 * 2 * 64 * 4


def test_short_context_stays_resident_and_a_small_budget_offloads():
    assert not plan("smollm2-135m", "cpu", context=4096, draft=None).offloaded
    small = plan_memory(arch_config("smollm2-135m"), load_profile("cpu").with_device_budget(600 * 10**6), 5000,
                        SpecParams(method="ar"), dtype_bytes=4)
    assert small.feasible and small.host_kv_bytes > 0.9 * 5000 * 46080


def test_host_that_is_too_small_says_how_long_a_context_fits():
    """The card's profile bounds no host memory; the machine's (here a 64 GB desktop's) does."""
    from triforce.plan.host_limits import planned_host_memory, with_host

    desktop = with_host(load_profile("rtx4090-24g"), planned_host_memory("64GB"))
    p = plan_memory(arch_config("llama2-7b-128k"), desktop, 200000, SpecParams(method="triforce"), dtype_bytes=2)
    assert not p.feasible and "the longest context that fits is about" in p.reason
    assert p.resident_kv_bytes > 0  # the GPU side was planned; only the host is short


def test_prefill_buffers_too_big_for_the_card_say_how_long_a_context_fits():
    p = plan("llama2-7b-128k", "rtx4090-24g", context=600000)
    assert not p.feasible and "a context of at most about" in p.reason


def test_expected_tokens_by_hand():
    assert expected_tokens(0.0, 5) == 1.0
    assert expected_tokens(1.0, 5) == 6.0
    assert expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)


def costs(**kw):
    base = dict(num_layers=10, weights_bytes=2 * 10**9, resident_kv_bytes=10**9, host_kv_bytes=10**9,
                retrieval_kv_bytes=10**9, draft_bytes=10**8, draft_layers=2, flops_per_token=4e9,
                draft_flops_per_token=2e8, attention_flops_per_key=4e5, context=10**5, budget=4096)
    return StepCosts(**{**base, **kw})


def test_cost_model_by_hand():
    memory_only = Hardware(hbm_gbps=1000, h2d_gbps=10)
    c = costs()
    # 1 GB over PCIe at 10 GB/s = 100 ms; 2 GB of weights + 1 GB resident at 1000 GB/s = 3 ms
    assert full_verify_ms(c, memory_only, 1) == pytest.approx(103.0)
    assert tier1_ms(c, memory_only, 1) == pytest.approx(3.0) and tier0_ms(c, memory_only) == pytest.approx(0.1)
    two_tier = triforce_ms_per_token(c, memory_only, Acceptance(full=0.5), gamma1=2, gamma2=2, has_tier0=False)
    assert two_tier["triforce_ms_per_token"] == pytest.approx((103 + 2 * 3) / 1.75)
    three = triforce_ms_per_token(c, memory_only, Acceptance(full=0.5, retrieval=0.5), gamma1=2, gamma2=2,
                                  has_tier0=True)
    assert three["triforce_ms_per_token"] == pytest.approx((103 + 2 / 1.75 * (3 + 2 * 0.1)) / 1.75)


def test_static_tree_by_hand():
    """One alternative per draft: 2 * gamma2 + 1 queries; where the chain breaks (1 - 0.5 ** 2 =
    0.75) the alternative is taken half the time: 1.75 + 0.375 tokens per verify."""
    memory_only = Hardware(hbm_gbps=1000, h2d_gbps=10)
    c = costs()
    chain = triforce_ms_per_token(c, memory_only, Acceptance(full=0.5), gamma1=2, gamma2=2, has_tier0=False)
    tree = static_tree_part(c, memory_only, chain, 0.5, 2, hit=0.5)
    assert tree["expected_tokens_per_full_verify"] == pytest.approx(1.75 + 0.375)
    assert tree["triforce_ms_per_token"] == pytest.approx((103 + 2 * 3) / 2.125)  # 5 queries cost no more bytes
    compute = Hardware(hbm_gbps=1000, h2d_gbps=10, compute_tflops=0.01)
    bound = triforce_ms_per_token(c, compute, Acceptance(full=0.5), gamma1=2, gamma2=2, has_tier0=False)
    never = static_tree_part(c, compute, bound, 0.5, 2, hit=0.0)
    assert never["triforce_ms_per_token"] > bound["triforce_ms_per_token"]  # compute-bound: the extra queries cost


def test_compute_and_per_layer_overhead_by_hand():
    hw = Hardware(hbm_gbps=1000, h2d_gbps=10, compute_tflops=1.0, layer_overhead_us=50)
    c = costs(host_kv_bytes=0)
    # 9 tokens x (4e9 + 4e5 x 1e5) flops = 9 x 4.4e10 = 3.96e11 flops at 1e12/s = 396 ms > 3 ms of bytes
    assert full_verify_ms(c, hw, 9) == pytest.approx(396 + 10 * 0.05)
    # one token of the draft: 0.1 GB at 1000 GB/s = 0.1 ms > 0.2 ms? no: 2e8 flops = 0.2 ms wins
    assert tier0_ms(c, hw) == pytest.approx(0.2 + 2 * 0.05)


def test_attention_has_its_own_arithmetic_rate_when_the_profile_gives_one():
    c = costs(host_kv_bytes=0)
    hw = Hardware(hbm_gbps=1000, h2d_gbps=10, compute_tflops=1.0, layer_overhead_us=50, attention_tflops=0.5)
    # projections 9 x 4e9 flops at 1e12/s = 36 ms; attention 9 x 4e5 x 1e5 = 3.6e11 flops at 5e11/s = 720 ms
    assert full_verify_ms(c, hw, 9) == pytest.approx(36 + 720 + 10 * 0.05)


def test_best_gammas_follow_acceptance():
    hw = Hardware(hbm_gbps=1000, h2d_gbps=10)
    c = costs()
    high = best_gammas(c, hw, Acceptance(full=0.98), has_tier0=False)
    low = best_gammas(c, hw, Acceptance(full=0.3), has_tier0=False)
    assert high[1] > low[1]
    # the choice is within the tie margin of the grid's minimum, and the longest such gamma2
    times = {g2: triforce_ms_per_token(c, hw, Acceptance(full=0.98), 1, g2, False)["triforce_ms_per_token"]
             for g2 in GAMMA2_RANGE}
    fastest = min(times.values())
    assert high[2] <= fastest * (1 + TIE_FRACTION)
    assert high[1] == max(g2 for g2, ms in times.items() if ms <= fastest * (1 + TIE_FRACTION))


def test_gamma2_controller_moves_with_observed_acceptance():
    hw = Hardware(hbm_gbps=1000, h2d_gbps=10)
    c = costs()
    lo, hi = gamma2_bounds(c, hw, Acceptance(), gamma1=2, has_tier0=True)
    assert lo < hi
    controller = Gamma2Controller(c, hw, Acceptance(), 2, True, (lo, hi))
    picks = [controller.choose(a) for a in (0.5, 0.7, 0.9, 0.99)]
    assert picks == sorted(picks) and picks[0] < picks[-1] and lo <= picks[0] and picks[-1] <= hi


def test_predictions_favour_triforce_at_long_context():
    result = plan("llama2-7b-128k", "rtx4090-24g")
    p = result.predictions
    assert p["triforce_ms_per_token"] < p["ar_offload_ms_per_token"]
    assert result.step_costs.host_kv_bytes > 40 * GiB  # read every verify: streamed, or the CPU's share in place
    assert p["pcie_bytes_per_full_verify"] == pytest.approx(result.step_costs.host_kv_bytes
                                                            * (1 - p["hybrid_cpu_share_verify"]), rel=2e-3)


def test_gamma1_controller_drops_refused_drafts_only_where_a_wider_check_costs():
    """A CPU's projections are arithmetic-bound: a 5-token check of the retrieval tier costs about
    twice a 1-token one, so drafts mostly refused cost more than they give; on a memory-bound
    device a wider check costs nearly nothing more, and every draft is worth checking."""
    c = costs(draft_bytes=0)  # prompt lookup: its drafts cost nothing to make
    cpu = Hardware(hbm_gbps=30, h2d_gbps=10, compute_tflops=0.08)
    gpu = Hardware(hbm_gbps=1000, h2d_gbps=10)
    assert tier1_ms(c, cpu, 5) > 2 * tier1_ms(c, cpu, 1)
    on_cpu = Gamma1Controller(c, cpu, 4)
    picks = [on_cpu.choose(a) for a in (0.0, 0.2, 0.6, 0.9, 1.0)]
    assert picks[0] == picks[1] == 0 and picks[-2] >= 1 and picks[-1] == 4 and picks == sorted(picks)
    assert [Gamma1Controller(c, gpu, 4).choose(a) for a in (0.0, 0.2, 0.9)] == [4, 4, 4]


@pytest.mark.parametrize("alpha, gamma", [(0.3, 1), (0.7, 4), (0.91, 8), (0.99, 15)])
def test_rate_from_fraction_inverts_the_fraction_a_run_reports(alpha, gamma):
    kept = (expected_tokens(alpha, gamma) - 1) / gamma  # what accepted / drafted comes to on average
    assert rate_from_fraction(kept, gamma) == pytest.approx(alpha, abs=1e-3)
    assert rate_from_fraction(kept, gamma) >= kept - 1e-3  # a check stops at its first rejection (equal at gamma 1)


def test_rate_from_fraction_refuses_what_is_no_fraction():
    with pytest.raises(OffloadError, match="accepted fraction"):
        rate_from_fraction(1.2, 8)


def test_a_wider_dtype_than_the_profile_was_measured_in_gets_a_lower_arithmetic_rate():
    from dataclasses import replace

    from triforce.plan.planner import hardware
    profile = load_profile("cpu")
    assert dict(profile.extras)["measured_dtype"] == "bfloat16"
    bf16, f32 = hardware(profile, 2), hardware(profile, 4)
    assert bf16.compute_tflops == profile.compute_tflops and bf16.attention_tflops == profile.attention_tflops
    assert f32.compute_tflops == pytest.approx(profile.compute_tflops / 2)
    assert f32.attention_tflops == pytest.approx(profile.attention_tflops / 2)
    assert f32.hbm_gbps == bf16.hbm_gbps  # bytes move at the same rate in any dtype
    unknown = replace(profile, extras=())
    assert hardware(unknown, 4).compute_tflops == profile.compute_tflops  # nothing said: nothing scaled


def test_snapkv_needs_the_whole_kv_on_the_device_and_keeps_its_window_of_queries():
    snap = SpecParams(method="snapkv", budget=4096)
    offloaded = plan("llama2-7b-128k", "rtx4090-24g", spec=snap, draft=None)
    assert not offloaded.feasible and "snapkv" in offloaded.reason and "offloaded" in offloaded.reason
    resident = plan("smollm2-135m", "cpu", context=8192, spec=snap, draft=None)
    retrieval = plan("smollm2-135m", "cpu", context=8192, spec=SpecParams(method="retrieval", budget=4096), draft=None)
    assert resident.feasible and not resident.offloaded
    assert resident.breakdown["chunk_means"] == 0 < retrieval.breakdown["chunk_means"]  # no mean keys to keep
    config = arch_config("smollm2-135m")
    one_token = config.num_layers * config.num_heads * config.head_dim * 2
    assert resident.breakdown["workspace"] - retrieval.breakdown["workspace"] == 31 * one_token


def test_hybrid_verify_is_planned_from_the_profile_s_cpu_rates():
    """With measured CPU attention rates the plan splits the host KV of short passes between PCIe
    and the CPU: ar-hybrid and triforce are predicted faster, the paper's ar-offload is not, and
    the bytes over PCIe per verify shrink by the CPU's share. A CPU profile's device is the CPU:
    no split."""
    from dataclasses import replace as with_rates

    from triforce.model.architectures import arch_config
    from triforce.offload.hybrid import HybridRates

    model, spec = arch_config("llama2-7b-128k"), SpecParams(method="triforce")
    streamed = load_profile("rtx4090-24g")
    streamed = with_rates(streamed, host_attention_gbps=None, host_attention_tflops=None)
    hybrid = with_rates(streamed, host_attention_gbps=40.0, host_attention_tflops=1.0)
    a = plan_memory(model, streamed, 130048, spec, dtype_bytes=2)
    b = plan_memory(model, hybrid, 130048, spec, dtype_bytes=2)
    assert a.hybrid is None and isinstance(b.hybrid, HybridRates)
    pa, pb = a.predictions, b.predictions
    assert pa["ar_offload_ms_per_token"] == pb["ar_offload_ms_per_token"]
    assert pb["ar_hybrid_ms_per_token"] < pb["ar_offload_ms_per_token"]
    assert pb["triforce_ms_per_token"] < pa["triforce_ms_per_token"]
    share = pb["hybrid_cpu_share_verify"]
    assert 0 < share < 1
    assert pb["pcie_bytes_per_full_verify"] == pytest.approx(pa["pcie_bytes_per_full_verify"] * (1 - share), rel=2e-3)
    cpu = with_rates(load_profile("cpu"), host_attention_gbps=40.0, host_attention_tflops=1.0)
    assert plan_memory(arch_config("smollm2-135m"), cpu.with_device_budget(200 << 20), 8192, spec,
                       dtype_bytes=2).hybrid is None


def test_decoding_holds_whole_host_blocks_in_the_prefill_s_scratch():
    """After prefill the scratch the layer-major prefill needed holds whole host blocks; the plan
    prices decoding with them on the GPU. A short context keeps everything resident."""
    p = plan("llama2-7b-128k", "rtx4090-24g")
    per_token = kv_bytes_per_token_layer(arch_config("llama2-7b-128k"), 2) * 32
    moved = p.decode_resident_tokens - p.resident_tokens
    assert moved > 0 and moved % p.block_tokens == 0
    assert moved * per_token <= p.breakdown["prefill_scratch"] < (moved + p.block_tokens) * per_token
    assert p.step_costs.host_kv_bytes == (130048 - p.decode_resident_tokens) * per_token
    short = plan("llama2-7b-128k", "h100-80g", context=4096)
    assert not short.offloaded and short.decode_resident_tokens == 4096


def test_block_kernels_rates_price_a_quantized_models_projections():
    """The cost model reads a quantized target's projections at the block kernels' measured rates
    (`profile tune` writes them per format); a mix of formats at the slower one; a format the
    profile has not measured, and floats, at the float rates. The draft stays float."""
    from dataclasses import replace

    from triforce.plan.cost_model import Hardware, StepCosts, full_verify_ms, tier0_ms

    hw = Hardware(hbm_gbps=20.0, h2d_gbps=16.0, compute_tflops=0.1, block_gbps=(("q4_1", 5.0), ("q8_0", 10.0)),
                  block_tflops=(("q4_1", 0.02), ("q8_0", 0.04)))
    assert hw.weight_rates("q4_1") == (5.0, 0.02) and hw.weight_rates("q4_1/q8_0") == (5.0, 0.02)
    assert hw.weight_rates(None) == hw.weight_rates("q4_k") == (20.0, 0.1)
    costs = StepCosts(num_layers=1, weights_bytes=10**9, resident_kv_bytes=0, host_kv_bytes=0, retrieval_kv_bytes=0,
                      draft_bytes=10**8, draft_layers=1, flops_per_token=4e9, draft_flops_per_token=1e8,
                      attention_flops_per_key=0, context=1, budget=1)
    assert full_verify_ms(costs, hw, 1) == pytest.approx(1e9 / 20e6)              # floats: 50 ms of bytes
    blocks = replace(costs, weights_format="q4_1")
    assert full_verify_ms(blocks, hw, 1) == pytest.approx(1e9 / 5e6)               # 200 ms of block bytes
    assert full_verify_ms(blocks, hw, 16) == pytest.approx(16 * 4e9 / 0.02e9)      # 16 rows: arithmetic-bound
    assert tier0_ms(blocks, hw) == tier0_ms(costs, hw) == pytest.approx(1e8 / 20e6)
    profile = replace(load_profile("cpu"), block_gbps=(("q4_k", 7.0),), block_tflops=(("q4_k", 0.03),))
    planned = [plan_memory(arch_config("smollm2-135m"), p, 4096, SpecParams(method="ar"), dtype_bytes=4,
                           weights="q4_k").predictions["ar_offload_ms_per_token"]
               for p in (replace(profile, block_gbps=(), block_tflops=()), profile)]
    assert planned[1] > planned[0]  # 7 GB/s of blocks against the float kernel's 33.2
