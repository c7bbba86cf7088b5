"""`bench prefill --breakdown` counts our CPU attention kernel (numba, which torch's profiler does
not see) as attention, not as the unexplained rest of the wall time; on a GPU it sorts the
profiler's kernels and copies by name and says how long no kernel ran."""
import torch
from torch.autograd import DeviceType
from torch.autograd.profiler_util import EventList, FunctionEvent

from triforce.bench.prefill_ttft import device_seconds, labelled_cpu_attention, op_seconds
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


def test_a_gpu_prefill_is_split_by_kernel_and_copy():
    """Events as the CUDA profiler records them (names from an H100 trace's kinds), 1 ms apart."""
    names = ["void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128>>",
             "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "nvjet_hsh_256x128_64x4_1x2_h_bz_coopA_NTN",
             "Memcpy HtoD (Pinned -> Device)", "Memcpy DtoH (Device -> Pinned)",
             "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>>"]
    events = EventList([FunctionEvent(i, name, 0, 1000 * i, 1000 * i + 1000, use_device="cuda",
                                      device_type=DeviceType.CUDA) for i, name in enumerate(names)]
                       + [FunctionEvent(9, "aten::mm", 0, 0, 5000)])  # a CPU op: its kernels are counted apart
    parts = device_seconds(events, wall_s=0.01)  # the events themselves, as key_averages sums them
    assert parts == {"copies_h2d_s": 0.001, "copies_d2h_s": 0.001, "attention_s": 0.001, "projections_s": 0.002,
                     "other_kernels_s": 0.001, "no_kernel_s": 0.006, "kernel_kinds_seen": 6}
