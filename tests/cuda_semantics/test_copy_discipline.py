"""Copy discipline outside the prefetcher: an asynchronous copy needs a pinned, contiguous host
side (else CUDA stages it through pageable memory and blocks). The prefetcher's copies go through
the streams interface, which the checked fake verifies (test_stream_order); every other
non_blocking copy in the package is listed here with why its host side is pinned, so a new one
must be looked at before it lands."""
import re
from pathlib import Path

import triforce

ROOT = Path(triforce.__file__).resolve().parent.parent
PACKAGE_DIRS = ("triforce_core", "offload", "pinned", "kernels", "bench")
ALLOWED = {
    ("offload/streams.py", "dst.copy_(src, non_blocking=True)"): "CudaStreams.copy: checked by the fake",
    ("triforce_core/decoding/graph_runner.py", "return host_ids([ids], device).to(device, non_blocking=True)"): "host_ids pins on CUDA",
    ("triforce_core/decoding/graph_runner.py", "view.tokens[0].copy_(inputs[0], non_blocking=True)"): "a row of host_ids",
    ("triforce_core/decoding/graph_runner.py", "view.slots.copy_(inputs[1], non_blocking=True)"): "a row of host_ids",
    ("triforce_core/decoding/verification.py", "tokens = host_ids([drafts], device).to(device, non_blocking=True)[0]"):
        "host_ids pins on CUDA",
    ("triforce_core/decoding/sampling.py", "ids = host_ids(padded, rows.device).to(rows.device, non_blocking=True)"):
        "host_ids pins on CUDA",
    ("offload/hybrid.py", "q_host.copy_(q, non_blocking=True)"): "q_host made with pin_memory=True",
    ("offload/hybrid.py", "return tuple(p.to(self.device, non_blocking=True) for p in pinned)"):
        "pinned made with pin_memory=True",
    ("triforce_core/cache/offloaded.py",
     "k, v = self.store.block_kv(self.store.block(layer, block).to(self.device, non_blocking=True), bt)"):
        "the host store is pinned (allocate_host)",
    ("triforce_core/cache/offloaded.py", "means = run.to(self.device, non_blocking=True).permute(1, 2, 0, 3)"):
        "host chunk means from allocate_host (pinned), a contiguous run of one layer's chunks",
    ("triforce_core/cache/offloaded.py",
     "host_k, host_v = host_k.to(self.device, non_blocking=True), host_v.to(self.device, non_blocking=True)"):
        "the gather staging from allocate_host (pinned); the next layer's index wait orders its reuse",
    ("triforce_core/plan/measure.py", "seconds = best_seconds(lambda: dst.copy_(src, non_blocking=pin), syncer(device))"):
        "pin is true only for a pinned source",
    ("bench/offload_bench.py", "dst.copy_(src, non_blocking=pin)"): "pin is true only for a pinned source",
    ("bench/campaign/gpu_probe.py", 'info["pinned_h2d_gbps"] = _gbps(lambda: dev.copy_(host, non_blocking=True), size, device)'):
        "host from allocate_host (pinned)",
    ("bench/campaign/gpu_probe.py", 'info["pinned_d2h_gbps"] = _gbps(lambda: host.copy_(dev, non_blocking=True), size, device)'):
        "host from allocate_host (pinned)",
}


def test_every_asynchronous_copy_site_is_known():
    found = set()
    for folder in PACKAGE_DIRS:
        for path in (ROOT / folder).rglob("*.py"):
            for line in path.read_text().splitlines():
                code = line.split("#")[0].strip()
                if re.search(r"(copy_|\.to)\(.*non_blocking\s*=\s*(?!False)", code):
                    found.add((str(path.relative_to(ROOT)), code))
    unknown = found - ALLOWED.keys()
    assert not unknown, f"new non_blocking copies: make their host side pinned and list them: {sorted(unknown)}"
    assert found == ALLOWED.keys(), f"stale entries: {sorted(ALLOWED.keys() - found)}"
