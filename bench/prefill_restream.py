"""Host KV streamed by an offloaded prefill, by query group: a second prompt after a first whose
KV went to the host, prefilled with groups of one chunk (the old schedule: every chunk re-streams
the old host blocks) and with the planner's group. Prints bytes copied and seconds side by side.

    python -m triforce.bench.prefill_restream [--arch smollm2-135m] [--first 4096] [--second 4096]
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from triforce.decoding.full_tier import FullTier
from triforce.model.architectures import build_random_model
from triforce.offload.offloaded_cache import OffloadedKVCache
from triforce.offload.planner import PREFILL_GROUP


def run(lm, first: list[int], second: list[int], chunk: int, group: int, resident: int, block: int) -> dict:
    max_len = len(first) + len(second) + 8
    cache = OffloadedKVCache(lm.config, max_len, resident, block, dtype=lm.dtype, device=lm.device, pin=False)
    full = FullTier(lm, max_len, cache, prefill_chunk=chunk, prefill_group=group)
    full.prefill(first)
    before = cache.prefetcher.stats.h2d_bytes
    started = time.perf_counter()
    logits = full.prefill(second)
    seconds = time.perf_counter() - started
    return {"group": group, "h2d_bytes": cache.prefetcher.stats.h2d_bytes - before, "seconds": round(seconds, 3),
            "logits": logits}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="smollm2-135m")
    parser.add_argument("--first", type=int, default=4096)
    parser.add_argument("--second", type=int, default=4096)
    parser.add_argument("--chunk", type=int, default=1024)
    args = parser.parse_args()
    torch.manual_seed(0)
    lm = build_random_model(args.arch, "float32", "cpu")
    ids = torch.randint(3, lm.config.vocab_size, (args.first + args.second,)).tolist()
    first, second = ids[:args.first], ids[args.first:]
    rows = [run(lm, first, second, args.chunk, group, resident=256, block=256)
            for group in (args.chunk, PREFILL_GROUP)]
    same = torch.allclose(rows[0].pop("logits"), rows[1].pop("logits"), atol=1e-4)
    print(json.dumps({"arch": args.arch, "first": args.first, "second": args.second, "chunk": args.chunk,
                      "rows": rows, "same_logits": same,
                      "bytes_ratio": round(rows[0]["h2d_bytes"] / max(rows[1]["h2d_bytes"], 1), 2),
                      "time_ratio": round(rows[0]["seconds"] / rows[1]["seconds"], 2)}))


if __name__ == "__main__":
    main()
