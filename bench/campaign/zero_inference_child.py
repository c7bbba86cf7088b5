"""DeepSpeed ZeRO-Inference decoding one Llama model at several prompt lengths, as DeepSpeedExamples'
`inference/huggingface/zero_inference/run_model.py --kv-offload` drives it: ZeRO stage 3 with that
script's settings, the KV cache in pinned host memory written asynchronously (the fork of
transformers it needs: decode-time attention on the CPU), greedy `generate`, the prefill timed as
the script's hooks time it (its first forward, synchronized). One process and one model for every length, with random weights made on
the card (a 7B model saved and read back would cost a lease a minute).

Runs in a process whose path holds the DeepSpeed kit (bench/build_deepspeed_kit.sh), never
triforce's transformers: started by deepspeed_peer.py, which writes the config and reads the JSON
this prints last. Without CUDA (the CPU rehearsal) the fork's KV offload cannot run (its copies go
through CUDA streams): the model decodes with its KV in place and the rows say so."""
from __future__ import annotations

import argparse
import gc
import json
import os
import time

KEPT: list = []  # transformers holds the DeepSpeed config by a weak reference


def ds_config(hidden_size: int, dtype) -> dict:
    """run_model.py's ZeRO stage 3 settings for one batch."""
    import torch

    return {"fp16": {"enabled": dtype == torch.float16}, "bf16": {"enabled": dtype == torch.bfloat16},
            "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 2 * hidden_size * hidden_size,
                                  "stage3_param_persistence_threshold": hidden_size,
                                  "stage3_max_live_parameters": 2 * hidden_size * hidden_size},
            "steps_per_print": 2000, "train_batch_size": 1, "wall_clock_breakdown": False}


def load(model_dir: str, dtype):
    import deepspeed
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.deepspeed import HfDeepSpeedConfig  # the fork's place for it

    config = AutoConfig.from_pretrained(model_dir)
    settings = ds_config(config.hidden_size, dtype)
    KEPT.append(HfDeepSpeedConfig(settings))  # while it lives, from_config builds under zero.Init
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, torch_dtype=dtype).eval()
    engine = deepspeed.initialize(model=model, config_params=settings)[0]
    engine.module.eval()
    return engine.module, config


def timed(model, config, context: int, new_tokens: int, loops: int, kv_offload: bool) -> dict:
    """Greedy generation after a random prompt of `context` tokens, run `loops` times; the last
    loop's prefill (run_model.py's hooks) and the rest of its time per new token."""
    import torch

    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    ids = torch.randint(3, config.vocab_size, (1, context), generator=torch.Generator().manual_seed(context)).to(device)
    if kv_offload:
        model.set_kv_cache_offload(True, new_tokens, True, True)  # pinned, asynchronous: its best settings
    forwards: list[float] = []  # as the kit's utils.add_model_hooks: the first forward is the prefill

    def ended(*_):
        sync()
        forwards.append(time.perf_counter())

    hook = model.register_forward_hook(ended)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    total = prefill = 0.0
    try:
        for _ in range(loops):
            forwards.clear()
            sync()
            started = time.perf_counter()
            with torch.no_grad():
                out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                     min_new_tokens=new_tokens, do_sample=False)
            sync()
            total, prefill = time.perf_counter() - started, forwards[0] - started
    finally:
        hook.remove()
    if out.shape[1] != context + new_tokens:
        raise RuntimeError(f"generated {out.shape[1] - context} tokens, not {new_tokens}")
    return {"context": context, "new_tokens": new_tokens, "kv_offload": kv_offload, "prefill_s": round(prefill, 3),
            "ms_per_token": round(1000 * (total - prefill) / max(1, new_tokens - 1), 2),
            "peak_gpu_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if device.type == "cuda" else None}


def out_of_memory(error: BaseException) -> bool:
    import torch

    return isinstance(error, torch.cuda.OutOfMemoryError) or "out of memory" in str(error).lower()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", required=True, help="A folder with the model's config.json.")
    parser.add_argument("--contexts", required=True, help="Prompt lengths, ascending, comma-separated.")
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--loops", type=int, default=2, help="Generations per length; the last is timed.")
    parser.add_argument("--dtype", default="float16", choices=("float16", "bfloat16", "float32"))
    args = parser.parse_args()
    import deepspeed
    import torch

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_WORLD_SIZE", "1")):
        os.environ.setdefault(name, value)
    if not torch.cuda.is_available():  # the rehearsal: the fork's generate loop synchronizes CUDA every token,
        torch.cuda.synchronize = lambda device=None: None  # and a CPU has nothing to wait for
    deepspeed.init_distributed("nccl" if torch.cuda.is_available() else "gloo")
    model, config = load(args.model_dir, getattr(torch, args.dtype))
    kv_offload = torch.cuda.is_available()
    rows, failures = [], []
    for context in (int(c) for c in args.contexts.split(",")):
        try:
            rows.append(timed(model, config, context, args.new_tokens, args.loops, kv_offload))
            print(f"zero-inference at {context}: {rows[-1]}", flush=True)
        except (RuntimeError, MemoryError) as e:  # out of memory at a length is a result
            failures.append({"context": context, "error": ("out of memory: " if out_of_memory(e) else "")
                             + str(e).strip().splitlines()[0][:300]})
            print(f"zero-inference at {context} failed: {failures[-1]['error']}", flush=True)
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    print(json.dumps({"peer": "deepspeed-zero-inference", "deepspeed": deepspeed.__version__, "kv_offload": kv_offload,
                      "rows": rows, "failures": failures}))


if __name__ == "__main__":
    main()
