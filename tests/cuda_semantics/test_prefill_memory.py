"""A long prompt prefilled through the offloaded path holds no more of the card than its plan.
The simulated card counts the bytes of every tensor it holds (card_tensors.CardMemory, what
torch.cuda.max_memory_allocated reports there). On an H200 capped to a 24 GB card (2026-11-28)
both campaign prefills ran out of memory: a layer's host-bound KV went home packed whole, twice
(stack, then contiguous), the merge of partial results made three temporaries of its output, and
the out-of-memory error gave up the fused partial kernel for the run."""
import importlib

import pytest
import torch

from cli_json import run_json
from triforce.kernels.partial import PartialAccumulator, partial_attention
from triforce.pinned.host_kv_store import HostKVStore

attention = importlib.import_module("triforce.kernels.attention")  # the package exports a function of that name


@pytest.mark.parametrize("arch,context,budget,offloaded", [
    ("tiny-test", 1000, "2.8MB", True),
    # the simulated card's float32 logits widened the whole head at once (98 MB over a 227 MB plan);
    # a card's mm with out_dtype makes no such copy, and neither does the simulation now
    ("llama-68m", 6000, "260MB", False),
])
def test_a_bf16_prefill_stays_within_its_plan(capsys, card, checked, arch, context, budget, offloaded):
    with card.placement():
        report = run_json(capsys, "bench", "prefill", "--arch", arch, "--context", context, "--new-tokens", "2",
                          "--device", "cuda", "--dtype", "bfloat16", "--device-budget", budget, "--json")
    assert report["offloaded"] == offloaded and report["device"] == "cuda:0"
    assert 0 < report["peak_gpu_bytes"] <= report["plan_gpu_bytes"]


def test_a_prefill_breakdown_takes_the_cuda_branch_on_the_card(capsys, card, checked):
    """`--breakdown` on a card asks the profiler for the device's activity; a torch without CUDA's
    profiler (this one) refused that list, so the campaign's prefill-32k step died on the simulated
    card. Here it runs, and says it recorded no kernel instead of calling the whole prefill idle."""
    with card.placement():
        report = run_json(capsys, "bench", "prefill", "--arch", "tiny-test", "--context", 1000, "--new-tokens", "2",
                          "--device", "cuda", "--dtype", "bfloat16", "--device-budget", "2.8MB", "--breakdown",
                          "--json")
    assert report["device"] == "cuda:0" and report["offloaded"] and report["kernel_kinds_seen"] == 0
    from triforce.bench.campaign.report import device_split
    assert "the profiler recorded no kernel" in device_split(report)


def test_sending_a_layer_home_holds_one_block_on_the_card(card):
    store = HostKVStore(1, 2, 16, capacity=4096, block_tokens=256, first_position=0, dtype=torch.float32, pin=False)
    with card.placement() as mode:
        k, v = (torch.randn(1, 2, 4000, 16).to("cuda") for _ in range(2))
        before = mode.memory.in_use
        mode.memory.reset_peak()
        store.write(0, 10, k, v)  # starts inside a block: 16 blocks touched
        extra = mode.memory.peak - before
    one_block = 256 * 2 * 2 * 16 * 4  # tokens x (K, V) x heads x dim x float32
    assert 0 < extra <= one_block, f"{extra} bytes on the card for a 4000-token layer (one block: {one_block})"
    k_home, v_home = store.read(10, 4010)
    assert torch.equal(k_home[0], k) and torch.equal(v_home[0], v)


def test_merging_partial_results_adds_no_output_sized_temporaries(card):
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 4, 512, 16, generator=g)
    parts = [partial_attention(q, *(torch.randn(1, 2, 64, 16, generator=g) for _ in range(2)), scale=0.25,
                               q_start=1000, k_start=64 * i) for i in range(3)]
    with card.placement() as mode:
        on_card = [(o.to("cuda"), lse.to("cuda")) for o, lse in parts]
        acc = PartialAccumulator()
        acc.add(*on_card[0])
        before = mode.memory.in_use
        mode.memory.reset_peak()
        for part in on_card[1:]:
            acc.add(*part)
        extra = mode.memory.peak - before
    output = q.nbytes
    assert extra < output, f"merging made {extra} bytes of temporaries (the output is {output})"
    ref = torch.stack([o for o, _ in parts]), torch.stack([lse for _, lse in parts])
    weights = torch.softmax(ref[1], 0)[..., None]
    torch.testing.assert_close(acc.result(torch.float32), (weights * ref[0]).sum(0), atol=1e-5, rtol=1e-5)


def test_running_out_of_memory_keeps_the_fused_kernel(monkeypatch):
    def full(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 128.00 MiB.")

    monkeypatch.setattr(attention, "fused_partial", full)
    sdpa = attention.SdpaAttention()
    q = torch.randn(1, 4, 8, 16).to(torch.bfloat16)
    k, v = (torch.randn(1, 2, 32, 16).to(torch.bfloat16) for _ in range(2))
    with pytest.raises(torch.OutOfMemoryError):
        sdpa.partial(q, k, v, scale=0.25, q_start=100, k_start=0)
    assert sdpa.fused_partial_failed is None


def test_the_campaign_cap_is_a_24gb_cards_memory_less_the_cuda_context(monkeypatch):
    """A card sold as 24 GB has 24 GiB, the CUDA context inside it: capping PyTorch at 24 * 10^9
    bytes left 22.35 GiB, under the 22.5 GiB the rtx4090-24g profile plans."""
    from fake_card import FakeCard
    from triforce.bench.campaign.capped import apply_cap

    h100 = FakeCard(total_bytes=80 << 30, others_bytes=520 << 20).install(monkeypatch)
    with h100.placement():
        line = apply_cap(24)
    assert h100.fractions[0] * (80 << 30) == pytest.approx((24 << 30) - (520 << 20))
    assert "23.49 GiB for PyTorch" in line and "0.51 GiB" in line
