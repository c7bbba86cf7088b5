"""Measuring the machine for a memory profile: memory per GPU and on the host, copy bandwidths,
device memory bandwidth (a copy, and what a matrix-vector product achieves), matmul rate at decode
shapes, and the CPU attention kernel's rate. Each measurement is
the best of a few repeats (the least disturbed one)."""
from __future__ import annotations

import os
import platform
import time
from typing import Callable

import psutil
import torch

REPEATS = 3


def best_seconds(fn: Callable[[], None], sync: Callable[[], None], repeats: int = REPEATS) -> float:
    fn()  # warm-up
    sync()
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - started)
    return best


def syncer(device: torch.device) -> Callable[[], None]:
    return (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)


def copy_gbps(device: torch.device, direction: str, num_bytes: int = 256 << 20) -> float:
    """Host-to-device ('h2d') or device-to-host ('d2h') copy rate with pinned host memory; on a
    CPU device, a memcpy."""
    pin = device.type == "cuda"
    host = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=pin)
    dev = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    src, dst = (host, dev) if direction == "h2d" else (dev, host)
    seconds = best_seconds(lambda: dst.copy_(src, non_blocking=pin), syncer(device))
    return num_bytes / seconds / 1e9


def memory_gbps(device: torch.device, num_bytes: int = 512 << 20) -> float:
    """Device memory bandwidth from a device-to-device copy, counting the bytes read and written."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = best_seconds(lambda: dst.copy_(src), syncer(device))
    return 2 * num_bytes / seconds / 1e9


def _decode_linear(device: torch.device):
    """What a model's projections run for a few rows: F.linear on CUDA, the small-rows kernel on
    a CPU (triforce.kernels.cpu.linear.dense)."""
    if device.type == "cuda":
        return torch.nn.functional.linear
    from triforce.kernels.cpu.linear.dense import linear
    return linear


def gemv_gbps(device: torch.device, dtype: torch.dtype) -> float:
    """Weights read per second by a matrix-vector product (one token through a projection)."""
    rows = 32768 if device.type == "cuda" else 16384
    weight = torch.randn(rows, 4096, device=device, dtype=dtype)
    x = torch.randn(1, 4096, device=device, dtype=dtype)
    linear = _decode_linear(device)
    seconds = best_seconds(lambda: linear(x, weight), syncer(device))
    return weight.nbytes / seconds / 1e9


def matmul_tflops(device: torch.device, dtype: torch.dtype, rows: int = 16) -> float:
    """Matmul rate at decode shapes (a verify pass: a few rows times a weight matrix)."""
    weight = torch.randn(16384, 4096, device=device, dtype=dtype)
    x = torch.randn(rows, 4096, device=device, dtype=dtype)
    linear = _decode_linear(device)
    seconds = best_seconds(lambda: linear(x, weight), syncer(device))
    return 2 * rows * weight.numel() / seconds / 1e12


def attention_tflops(device: torch.device, dtype: torch.dtype, queries: int = 9, num_keys: int = 16384,
                     heads: int = 9, kv_heads: int = 3, dim: int = 64, layers: int = 8) -> float:
    """Attention's arithmetic rate in a verify pass (`queries` new tokens over a long cache, the
    default model's heads), through the kernel decoding runs there: the CPU decoding kernel
    (triforce.kernels.cpu.attention.decode), SDPA on CUDA. A pass of a few queries is compute-bound where
    one query is bound by reading the KV (attention_gbps). `layers` distinct caches in turn (100
    MB in bfloat16 at the defaults), as a pass reads them: one 12 MB cache stayed in a CPU's L3
    and measured a rate that passes over caches in memory do not reach."""
    q = torch.randn(1, heads, queries, dim, device=device, dtype=dtype)
    kv = [(torch.randn(1, kv_heads, num_keys, dim, device=device, dtype=dtype),
           torch.randn(1, kv_heads, num_keys, dim, device=device, dtype=dtype)) for _ in range(layers)]
    from triforce.kernels.cpu.attention import decode as cpu_attention
    if device.type == "cpu" and cpu_attention.takes(q, *kv[0], None):
        def run():
            for k, v in kv:
                cpu_attention.attention(q, k, v, scale=dim ** -0.5)
    else:
        kv = [tuple(t.repeat_interleave(heads // kv_heads, 1) for t in pair) for pair in kv]

        def run():
            for k, v in kv:
                torch.nn.functional.scaled_dot_product_attention(q, k, v)
    seconds = best_seconds(run, syncer(device))
    return 4 * heads * queries * num_keys * dim * layers / seconds / 1e12


def host_attention_rates(dtype: torch.dtype = torch.bfloat16, num_keys: int = 16384, kv_heads: int = 32,
                         dim: int = 128, block_tokens: int = 2048, verify_tokens: int = 9) -> tuple[float, float]:
    """(GB/s, TFLOP/s) of the CPU attending over host KV blocks in place (the hybrid verify's CPU
    half, triforce.kernels.cpu.attention.host): KV bytes read per second with one query token per KV
    head (bound by memory), and the arithmetic rate of a `verify_tokens` pass. Llama2-7B's heads
    (MHA, 32 x 128) in blocks as the host store lays them out, 256 MB in bfloat16."""
    from triforce.kernels.cpu.attention.host import host_partial

    blocks = num_keys // block_tokens
    data = torch.randn(blocks, block_tokens, 2, 1, kv_heads, dim, dtype=dtype)
    index, counts = list(range(blocks)), [block_tokens] * blocks

    def seconds(tokens: int) -> float:
        q = torch.randn(1, kv_heads, tokens, dim, dtype=dtype)
        return best_seconds(lambda: host_partial(q, data, index, counts, scale=dim ** -0.5), lambda: None)

    gbps = data.nbytes / seconds(1) / 1e9
    tflops = 4 * kv_heads * verify_tokens * num_keys * dim / seconds(verify_tokens) / 1e12
    return gbps, tflops


def gpu_memory() -> list[tuple[int, int, str]]:
    """(free, total, name) per GPU, from NVML (falling back to the CUDA runtime)."""
    out = []
    try:
        import pynvml
        pynvml.nvmlInit()
        try:
            for i in range(pynvml.nvmlDeviceGetCount()):
                handle = pynvml.nvmlDeviceGetHandleByIndex(i)
                info = pynvml.nvmlDeviceGetMemoryInfo(handle)
                name = pynvml.nvmlDeviceGetName(handle)
                out.append((int(info.free), int(info.total), name.decode() if isinstance(name, bytes) else name))
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no NVML library or no driver: ask the CUDA runtime
        for i in range(torch.cuda.device_count() if torch.cuda.is_available() else 0):
            free, total = torch.cuda.mem_get_info(i)
            out.append((free, total, torch.cuda.get_device_name(i)))
    return out


def host_memory() -> tuple[int, int]:
    """(available, total) bytes of host memory."""
    vm = psutil.virtual_memory()
    return int(vm.available), int(vm.total)


def machine_name() -> str:
    return f"{platform.node() or 'host'} ({platform.machine()}, {os.cpu_count()} CPUs)"
