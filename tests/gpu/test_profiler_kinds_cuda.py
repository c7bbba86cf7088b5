"""`bench prefill --breakdown` on a card sorts the CUDA profiler's kernels by name: a GEMM as a
projection, torch's flash attention as attention, a pinned host-to-device copy as a copy in. The
names are the card's and cuBLAS's (written on a CPU: only a card can say them). Skipped without CUDA."""
import pytest
import torch
import torch.nn.functional as F

from triforce.bench.prefill_ttft import device_seconds

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_a_gemm_flash_attention_and_a_copy_land_in_their_kinds():
    a = torch.randn(2048, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    q, k, v = (torch.randn(1, 8, 1024, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    host = torch.randn(64 << 20 >> 2).pin_memory()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profiler:
        a @ w
        F.scaled_dot_product_attention(q, k, v, is_causal=True)
        host.to("cuda", non_blocking=True)
        torch.cuda.synchronize()
    events = profiler.key_averages()
    parts = device_seconds(events, wall_s=1.0)
    names = sorted(e.key for e in events)
    assert parts["projections_s"] > 0 and parts["attention_s"] > 0 and parts["copies_h2d_s"] > 0, names
    assert parts["no_kernel_s"] < 1.0
