"""`bench prefill --breakdown` counts our CPU attention kernel (numba, which torch's profiler does
not see) as attention, not as the unexplained rest of the wall time."""
import torch

from triforce.bench.prefill_ttft import labelled_cpu_attention, op_seconds
from triforce.kernels import attention
from triforce.kernels.cpu.attention import decode


def test_our_cpu_attention_counts_as_attention():
    k, v = torch.randn(2, 1, 3, 600, 64).to(torch.bfloat16)
    q = torch.randn(1, 9, 1, 64).to(torch.bfloat16)
    assert decode.takes(q, k, v, None)  # a decoding step's attention: our kernel
    with torch.profiler.profile() as profiler, labelled_cpu_attention():
        attention(q, k, v, scale=0.125)
    events = profiler.key_averages()
    assert any(e.key == "triforce::cpu_attention" for e in events)
    assert op_seconds(events)["attention_s"] > 0
    assert decode.attention.__name__ == "attention"  # put back afterwards
