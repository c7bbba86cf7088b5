"""The peers `triforce bench offload` times triforce against, beside ar-offload.

The ZeRO-Inference-style baseline: the whole KV cache lives in host memory and attention runs
on the CPU, as DeepSpeed ZeRO-Inference's KV offload does. Each layer sends its query and new K/V
to the host and gets the attention output back; weights stay on the device. Only plain
autoregressive decoding uses it.

Its attention is the project's own multi-threaded kernel over host blocks
(triforce.kernels.cpu.attention.host, the hybrid verify's CPU half), so the baseline is the strongest
version of that design rather than a scalar loop."""
from __future__ import annotations

import time

import torch

from triforce.cache_contract import CacheStep
from triforce.kernels import attention
from triforce.kernels.cpu.attention.host import host_partial
from triforce.kernels.cpu.attention.host import takes as host_attention_takes
from triforce.pinned import HostKVStore

BLOCK_TOKENS = 1024


class HostAttentionKVCache:
    """The KV of every token in a host KV store (token-major blocks of BLOCK_TOKENS, from position 0)."""

    layer_major = False

    def __init__(self, cfg, max_len: int, *, dtype: torch.dtype, device: torch.device | str, batch: int = 1,
                 host_budget_bytes: int | None = None, host_arena=None):
        # pageable: the CPU computes on it, nothing is copied from it to the device (a benchmark
        # may lend it a pinned arena's bytes: the CPU reads them the same)
        self.store = HostKVStore(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, max_len, BLOCK_TOKENS,
                                 first_position=0, dtype=dtype, batch=batch, pin=False, budget_bytes=host_budget_bytes,
                                 arena=host_arena)
        self.device = torch.device(device)
        self.max_len, self.length = max_len, 0
        self.scale = cfg.head_dim ** -0.5
        self.sliding_windows = cfg.sliding_windows
        self.h2d_bytes = self.d2h_bytes = 0

    @property
    def nbytes(self) -> int:
        return 0  # nothing of the cache is on the device

    @property
    def host_nbytes(self) -> int:
        return self.store.nbytes

    def step(self, num_new: int, record_queries: bool = False, prefill: bool = False) -> "HostAttentionStep":
        if record_queries:
            raise ValueError("the ZeRO-Inference baseline runs plain autoregressive decoding only")
        if self.length + num_new > self.max_len:
            raise ValueError(f"context full: {self.length} + {num_new} tokens exceed {self.max_len}")
        start = self.length
        self.length += num_new
        return HostAttentionStep(self, start, self.length)

    def rollback(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot roll back to {length}: cache holds {self.length}")
        self.length = length

    def prepare_verify(self) -> None:
        """Nothing to prefetch: attention runs where the KV is."""

    def layer_kv(self, layer: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of k, v [B, Hkv, end, D] of `layer` (the prefill's attention reads them)."""
        parts = [self.store.block_kv(self.store.block(layer, b), min(self.store.block_tokens, end - self.store.block_start(b)))
                 for b in range(-(-end // self.store.block_tokens))]
        return torch.cat([k for k, _ in parts], dim=2), torch.cat([v for _, v in parts], dim=2)


class HostAttentionStep(CacheStep):
    def __init__(self, cache: HostAttentionKVCache, start: int, end: int):
        super().__init__(start, end, torch.arange(start, end, device=cache.device)[None], cache.store.data.shape[0])
        self.cache = cache

    def write(self, layer: int, first: int, k: torch.Tensor, v: torch.Tensor) -> None:
        c = self.cache
        c.store.write(layer, first, k.to("cpu"), v.to("cpu"))
        c.d2h_bytes += k.nbytes + v.nbytes

    def attend_written(self, layer: int, q: torch.Tensor, first: int) -> torch.Tensor:
        c, end = self.cache, first + q.shape[2]
        q_host = q.to("cpu")
        c.d2h_bytes += q.nbytes
        window = c.sliding_windows[layer]
        if q.shape[2] == 1 and window is None and host_attention_takes(c.store.data.dtype):
            bt = c.store.block_tokens
            blocks = list(range(-(-end // bt)))
            out, _ = host_partial(q_host, c.store.data[layer], blocks, [min(bt, end - b * bt) for b in blocks],
                                  scale=c.scale)
        else:  # prefill (the baseline times decoding): torch's vectorised CPU attention
            k, v = c.layer_kv(layer, end)
            out = attention(q_host, k.to(q_host.dtype), v.to(q_host.dtype), scale=c.scale, sliding_window=window)
        out = out.to(device=c.device, dtype=q.dtype)
        c.h2d_bytes += out.nbytes
        return out


# The peer a user would pick: transformers' own offloaded KV cache (DynamicCache(offloading=True),
# what generate(..., cache_implementation="offloaded") builds), on the same architecture with random
# weights. Each layer's whole KV is fetched from the host for every token and the new token appended,
# so it moves the host KV twice per token. CUDA only (the cache prefetches on a CUDA stream).
def time_hf_offloaded(arch: str, context: int, new_tokens: int, dtype: torch.dtype, device: torch.device) -> dict:
    """ms/token of greedy decoding with transformers' offloaded cache after `context` tokens of
    random KV (filled layer by layer, not prefilled: decoding time does not depend on the values)."""
    if device.type != "cuda":
        raise RuntimeError("transformers' offloaded cache prefetches on a CUDA stream: CUDA only")
    from transformers import AutoModelForCausalLM, DynamicCache

    from triforce.model.architectures import arch_hf_config

    config = arch_hf_config(arch)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model = model.to_empty(device=device).eval()
    generator = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02, generator=generator) if p.dim() == 2 else p.fill_(1.0)
    cache = DynamicCache(config=config, offloading=True)
    heads, dim = config.num_key_value_heads, config.hidden_size // config.num_attention_heads
    kv = torch.randn(1, heads, context, dim, dtype=dtype, device=device, generator=generator)
    with torch.no_grad():
        for layer in range(config.num_hidden_layers):
            cache.update(kv, kv.clone(), layer)  # the cache offloads each layer to the host
    del kv
    token = torch.ones(1, 1, dtype=torch.long, device=device)
    times = []
    with torch.inference_mode():
        for i in range(new_tokens + 2):  # two warm-up steps
            torch.cuda.synchronize(device)
            started = time.perf_counter()
            position = torch.tensor([context + i], device=device)
            logits = model(input_ids=token, past_key_values=cache, use_cache=True, cache_position=position).logits
            token = logits[:, -1:].argmax(-1)
            torch.cuda.synchronize(device)
            times.append(time.perf_counter() - started)
    timed = times[2:]
    return {"method": "transformers-offloaded", "tokens": len(timed),
            "ms_per_token": round(1000 * sum(timed) / len(timed), 2),
            "peak_gpu_bytes": torch.cuda.max_memory_allocated(device)}
