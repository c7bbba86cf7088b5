"""`triforce profile tune`: measure this machine and describe it as a memory profile."""
from __future__ import annotations

import datetime
import platform
import time

import torch

from triforce.plan import measure
from triforce.plan.profiles import HOST_UNBOUNDED, MemoryProfile

STEPS = ("memory", "host-to-device copy", "device-to-host copy", "device memory copy", "matrix-vector product",
         "decode-shaped matmul", "forward-pass calibration", "verify-pass attention", "CPU attention over host KV",
         "block-quantized weights")
BLOCK_VERIFY_ROWS = 16


CALIBRATION_ARCH = "smollm2-135m"  # the default model's shape: realistic per-layer op mix, quick to build
CALIBRATION_CONTEXT = 4096


def calibrate_forward(device: torch.device, dtype: torch.dtype, weights_gbps: float) -> tuple[float, float]:
    """(per-layer overhead in us, attention GB/s) from one-token forwards of a real decoder (random
    weights) through the real model code: at a tiny context, whatever the weights' bytes do not
    explain is overhead; the extra time at a long context is the attention reading the KV."""
    from triforce.model.architectures import build_random_model
    from triforce.cache.resident import ResidentKVCache
    from triforce.offload.shapes import kv_bytes_per_token_layer, weight_bytes

    lm = build_random_model(CALIBRATION_ARCH, str(dtype).removeprefix("torch."), str(device))
    cfg = lm.config
    cache = ResidentKVCache(cfg, CALIBRATION_CONTEXT + 8, dtype=lm.dtype, device=lm.device)
    token = torch.zeros(1, 1, dtype=torch.long, device=lm.device)

    def forward_seconds(context: int) -> float:
        def run():
            cache.length = context
            step = cache.step(1)
            lm.model(token, step.positions, step)
        best = float("inf")
        run()
        for _ in range(5):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            started = time.perf_counter()
            run()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            best = min(best, time.perf_counter() - started)
        return best

    element = lm.model.lm_head.weight.element_size()
    short, long = forward_seconds(16), forward_seconds(CALIBRATION_CONTEXT)
    weights_s = weight_bytes(cfg, element) / (weights_gbps * 1e9)
    overhead_us = max(short - weights_s, 0.0) / cfg.num_layers * 1e6
    kv_bytes = (CALIBRATION_CONTEXT - 16) * kv_bytes_per_token_layer(cfg, element) * cfg.num_layers
    attention_gbps = kv_bytes / max(long - short, 1e-9) / 1e9
    return overhead_us, attention_gbps


def block_rates(device: torch.device) -> tuple[tuple, tuple]:
    """Per block format, ((format, GB/s), ...) of block bytes read with one input row through a
    projection of random blocks (the numba kernels on a CPU, Triton's on a GPU; none there without
    triton), and ((format, TFLOP/s), ...) with BLOCK_VERIFY_ROWS rows. A CPU's 4-bit kernel is
    bound by its arithmetic, not by memory, so the float matrix-vector rate would overstate it."""
    import importlib.util

    from triforce.kernels.cpu.linear.block_formats import FILE_FORMATS
    from triforce.model.quantized import random_block
    from triforce.model.quantized_layers import block_linear

    if device.type == "cuda" and importlib.util.find_spec("triton") is None:
        return (), ()
    rows, cols = (32768 if device.type == "cuda" else 16384), 4096
    activations = torch.bfloat16 if device.type == "cuda" else torch.float32
    generator = torch.Generator(device=device).manual_seed(0)
    gbps, tflops = [], []
    for kind in FILE_FORMATS:  # q6_k too: files mix it with q4_k
        block = random_block(kind, rows, cols, device, generator)
        linear = block_linear(block)
        one, many = (torch.randn(n, cols, dtype=activations, device=device) for n in (1, BLOCK_VERIFY_ROWS))
        gbps.append((kind, round(block.nbytes / measure.best_seconds(lambda: linear(one), measure.syncer(device)) / 1e9, 3)))
        seconds = measure.best_seconds(lambda: linear(many), measure.syncer(device))
        tflops.append((kind, round(2 * BLOCK_VERIFY_ROWS * rows * cols / seconds / 1e12, 4)))
    return tuple(gbps), tuple(tflops)


def tune(name: str | None, acceptance_rows: list[dict], progress=None) -> MemoryProfile:
    """Measure everything in STEPS (progress(step) before each) and build the profile."""
    from triforce.model.loading import resolve_dtype

    values: dict = {}
    device = torch.device("cpu")
    for step in STEPS:
        if progress is not None:
            progress(step)
        if step == "memory":
            values["gpus"], values["host"] = measure.gpu_memory(), measure.host_memory()
            if values["gpus"] and torch.cuda.is_available():
                device = torch.device("cuda:0")
            dtype = resolve_dtype("auto", device)  # what models run in here: the rates to plan them by
        elif step == "host-to-device copy":
            values["h2d"] = measure.copy_gbps(device, "h2d")
        elif step == "device-to-host copy":
            values["d2h"] = measure.copy_gbps(device, "d2h")
        elif step == "device memory copy":
            values["copy"] = measure.memory_gbps(device)
        elif step == "matrix-vector product":
            values["gemv"] = measure.gemv_gbps(device, dtype)
        elif step == "decode-shaped matmul":
            values["tflops"] = measure.matmul_tflops(device, dtype)
        elif step == "forward-pass calibration":
            values["overhead"], values["attention"] = calibrate_forward(device, dtype, values["gemv"])
        elif step == "verify-pass attention":
            values["attention_tflops"] = measure.attention_tflops(device, dtype)
        elif step == "CPU attention over host KV":
            values["host_attention"] = measure.host_attention_rates(dtype if dtype != torch.float64 else torch.float32)
        else:
            values["blocks"] = block_rates(device)
    available = values["host"][0]
    gpus = values["gpus"] if device.type == "cuda" else []
    if gpus:
        gpu_bytes = min(total for _, total, _ in gpus)
        reserved = max(total - free for free, total, _ in gpus) + (512 << 20)
        # the cards: the host memory is read when a run plans (plan.host_limits), not frozen here
        host_bytes, description = HOST_UNBOUNDED, f"{len(gpus)} x {gpus[0][2]}, measured"
    else:  # the CPU is the device: most of the memory for the model, a share for an emulated host store
        gpu_bytes, reserved, host_bytes = int(0.6 * available), 0, int(0.25 * available)
        description = f"CPU only ({platform.machine()}), measured"
    extras = {"copy_gbps": round(values["copy"], 3),
              "machine": measure.machine_name(), "measured_on": datetime.date.today().isoformat(),
              "measured_dtype": str(dtype).removeprefix("torch.")}
    if acceptance_rows:
        extras["acceptance"] = acceptance_rows
    return MemoryProfile(
        name=name or f"tuned-{platform.node() or 'host'}", description=description, num_gpus=len(gpus),
        gpu_bytes=gpu_bytes, reserved_bytes=min(reserved, gpu_bytes - 1), host_bytes=host_bytes,
        pcie_h2d_gbps=round(values["h2d"], 3), pcie_d2h_gbps=round(values["d2h"], 3),
        hbm_gbps=round(values["gemv"], 3), cpu_threads=torch.get_num_threads(), measured=True,
        compute_tflops=round(values["tflops"], 4), layer_overhead_us=round(values["overhead"], 2),
        attention_gbps=round(values["attention"], 3), attention_tflops=round(values["attention_tflops"], 4),
        host_attention_gbps=round(values["host_attention"][0], 3),
        host_attention_tflops=round(values["host_attention"][1], 4),
        block_gbps=values["blocks"][0], block_tflops=values["blocks"][1], extras=tuple(extras.items()))
