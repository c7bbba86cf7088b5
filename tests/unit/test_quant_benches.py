"""The block-kernel benches run end to end on a CPU (the numba kernels stand in for Triton's) and
their JSON becomes the GPU campaign's RESULTS rows: bench/quant_kernels.py and tier_steps.py
with --quantize, on a small architecture."""
import json
import subprocess
import sys

from triforce.bench.gpu_campaign import results_rows


def run_json(*argv) -> dict:
    done = subprocess.run([sys.executable, "-m", *argv, "--json"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_block_kernel_benches_run_and_make_rows():
    kernels = run_json("triforce.bench.quant_kernels", "--arch", "llama-68m", "--rows", "1,4", "--formats", "q4_k",
                       "--dtype", "float32", "--repeats", "3")
    by = {(r["matrix"], r["weights"], r["rows"]): r for r in kernels["rows"]}
    assert len(by) == 4 * 2 * 2 and all(r["ms"] > 0 and r["x_floor"] > 0 for r in by.values())
    for matrix in ("qkv", "o", "gate_up", "down"):  # q4_k holds 24 bytes per 32 weights against float32's 128
        assert by[(matrix, "q4_k", 1)]["weight_bytes"] * 128 == by[(matrix, "float", 1)]["weight_bytes"] * 24
    tiers = run_json("triforce.bench.tier_steps", "--arch", "llama-68m", "--draft", "", "--contexts", "512",
                     "--dtype", "float32", "--attn", "sdpa", "--quantize", "q4_1", "--repeats", "2")
    assert tiers["quantize"] == "q4_1" and tiers["rows"] and all(r["tier1_ms"] > 0 for r in tiers["rows"])
    report = {"date": "2026-11-26", "cap_gb": 24, "quick": False, "environment": {},
              "steps": [{"name": "quant-kernels", "ok": True, "rc": 0, "seconds": 1, "result": kernels},
                        {"name": "tier-steps-q4k", "ok": True, "rc": 0, "seconds": 1, "result": tiers}]}
    text = "\n".join(results_rows(report))
    assert "| gate_up | q4_k | 4 |" in text and "weights q4_1" in text
