"""The peer a user would pick: transformers' own offloaded KV cache (`DynamicCache(offloading=True)`,
what `generate(..., cache_implementation="offloaded")` builds), timed on the same architecture
with random weights. Each layer's whole KV is fetched from the host for every token and the new
token appended, so it moves the host KV twice per token; nothing of triforce is used beyond the
timing. CUDA only (the cache prefetches on a CUDA stream)."""
from __future__ import annotations

import time

import torch


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
