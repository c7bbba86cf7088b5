"""First step of the GPU campaign: what the device is and what its copies achieve, as one JSON line.

Device name and versions; whether flash-attn and Triton import; exact pinning (a 1.5 GiB host
buffer registered at its size, seen as pinned by CUDA); pinned and pageable host-to-device and
device-to-device bandwidth; and which SDPA kernels serve the attention calls triforce makes
(a call that only the math kernel can serve fails under sdpa_kernel without MATH)."""
from __future__ import annotations

import json
import time

import torch


def _gbps(fn, num_bytes: int, device, repeats: int = 5) -> float:
    fn()
    torch.cuda.synchronize(device)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - started)
    return round(num_bytes / best / 1e9, 2)


def sdpa_fused_only(device) -> dict:
    """For each attention call shape of triforce: does it run without the math kernel?"""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from triforce.kernels.attention import attention

    cases = {  # (heads, kv_heads, queries, keys)
        "decode gqa": (32, 8, 1, 4096), "verify gqa (masked)": (32, 8, 7, 4096),
        "prefill chunk gqa (masked)": (32, 8, 1024, 8192), "prefill square gqa": (32, 8, 1024, 1024),
        "verify mha (masked)": (32, 32, 7, 4096), "prefill chunk mha (masked)": (32, 32, 1024, 8192),
    }
    out = {}
    for name, (heads, kv_heads, t, s) in cases.items():
        q = torch.randn(1, heads, t, 128, device=device, dtype=torch.bfloat16)
        k = torch.randn(1, kv_heads, s, 128, device=device, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        ref = attention(q.double(), k.double(), v.double(), scale=128 ** -0.5)
        if heads != kv_heads and t != s:  # the call triforce made before: a mask with enable_gqa
            from triforce.kernels.attention import causal_mask
            try:
                with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                                  SDPBackend.CUDNN_ATTENTION]):
                    torch.nn.functional.scaled_dot_product_attention(
                        q, k, v, attn_mask=causal_mask(t, s, device), scale=128 ** -0.5, enable_gqa=True)
                out[name + ", mask with enable_gqa"] = "fused kernel"
            except RuntimeError as e:
                out[name + ", mask with enable_gqa"] = f"needs the math kernel: {str(e).splitlines()[0][:80]}"
        try:
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]):
                got = attention(q, k, v, scale=128 ** -0.5)
            err = float((got.double() - ref).norm() / ref.norm())
            out[name] = f"fused kernel, rel err {err:.1e}"
        except RuntimeError as e:
            out[name] = f"needs the math kernel: {str(e).splitlines()[0][:120]}"
    return out


def main() -> None:
    info: dict = {"torch": torch.__version__, "cuda_available": torch.cuda.is_available()}
    try:
        import triton
        info["triton"] = triton.__version__
    except ImportError as e:
        info["triton"] = f"not importable: {e}"
    try:
        import flash_attn
        info["flash_attn"] = flash_attn.__version__
    except ImportError as e:
        info["flash_attn"] = f"not importable: {e}"
    if not torch.cuda.is_available():
        print(json.dumps(info))
        return
    from triforce.model.loading import resolve_device

    device = resolve_device("cuda")
    props = torch.cuda.get_device_properties(device)
    info.update(device_name=torch.cuda.get_device_name(device), cuda=torch.version.cuda,
                total_gb=round(props.total_memory / 1e9, 1), sms=props.multi_processor_count)
    from triforce.pinned import allocate_host, pinned_bytes

    size = 3 << 29  # 1.5 GiB: the caching host allocator would lock 2 GiB
    (host,) = allocate_host([(size,)], torch.uint8, what="probe buffer")
    info.update(exact_pin_is_pinned=host.is_pinned(), exact_pin_bytes=pinned_bytes(), exact_pin_asked=size)
    dev = torch.empty(size, dtype=torch.uint8, device=device)
    info["pinned_h2d_gbps"] = _gbps(lambda: dev.copy_(host, non_blocking=True), size, device)
    info["pinned_d2h_gbps"] = _gbps(lambda: host.copy_(dev, non_blocking=True), size, device)
    pageable = torch.empty(size, dtype=torch.uint8)
    info["pageable_h2d_gbps"] = _gbps(lambda: dev.copy_(pageable), size, device)
    other = torch.empty_like(dev)
    info["d2d_gbps"] = _gbps(lambda: other.copy_(dev), 2 * size, device)  # bytes read + written
    info["sdpa"] = sdpa_fused_only(device)
    print(json.dumps(info))


if __name__ == "__main__":
    main()
