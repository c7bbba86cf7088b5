"""The GPU campaign's record as rows for bench/RESULTS.md: the steps' outcomes, then a table per
kind of step (the user's commands, prefill and time to first token, offloaded decoding, the
block kernels, tier steps), each from the JSON its step printed or, for a step cut short, wrote
as it went."""
from __future__ import annotations


def results_rows(report: dict) -> list[str]:
    """Markdown lines for bench/RESULTS.md."""
    probe = next((s["result"] for s in report["steps"] if s["name"] == "probe" and s["result"]), {}) or {}
    env = report.get("environment", {})
    lines = [f"GPU campaign {report['date']}, {env.get('device') or probe.get('device_name', 'device unknown')}, "
             f"driver {env.get('driver', '?')}, memory capped to {report['cap_gb']:g} GB, torch "
             f"{env.get('torch') or probe.get('torch', '?')}, commit {env.get('commit', '?')}, pinned host-to-device "
             f"{probe.get('pinned_h2d_gbps', '?')} GB/s, device copy {probe.get('d2d_gbps', '?')} GB/s",
             "", f"    python -m triforce.bench.gpu_campaign{' --quick' if report['quick'] else ''}", "",
             "| step | result | seconds |", "|---|---|---:|"]
    for s in report["steps"]:
        status = "ok" if s["ok"] else ("timed out" if s["rc"] == "timeout" else f"failed (exit {s['rc']})")
        lines.append(f"| {s['name']} | {status} | {s['seconds']} |")
    for s in report["steps"]:
        r = s["result"] or {}
        if s["name"] == "user" and r.get("steps"):
            lines += ["", f"user step on {r['device']} (default dtype {r['default_dtype']}): greedy float32 tokens "
                          f"equal transformers' generate: {r['greedy_float32_equals_transformers']}", "",
                      "| command | result | seconds |", "|---|---|---:|"]
            for u in r["steps"]:
                result = "ok" if u["ok"] else f"failed (exit {u.get('rc')}) {u.get('error', '')}".strip()
                lines.append(f"| `{u['command'].split(' --model')[0]}` | {result} | {u['seconds']} |")
        if s["name"].startswith("offload") and r.get("rows"):
            cut = " (cut short: the rows timed before it ended)" if r.get("cut") else ""
            lines += ["", f"{s['name']}: context {r.get('context')}, {r.get('profile')}, pinned H2D "
                          f"{r.get('pinned_h2d_gbps')} GB/s, trace {r.get('replayed_trace')}{cut}",
                      "", "| method | ms/token | PCIe MB/token | H2D GB/s | peak GPU GiB | plan GiB |",
                      "|---|---:|---:|---:|---:|---:|"]
            for row in r["rows"]:
                if "error" in row:
                    lines.append(f"| {row['method']} | failed or does not fit: {row['error']} | | | | |")
                    continue
                peak = row["peak_gpu_bytes"] / 2**30 if row.get("peak_gpu_bytes") else float("nan")
                windows = "/".join(str(w) for w in row.get("ms_per_token_windows", []))
                pcie = f"{row['pcie_bytes_per_token'] / 1e6:.1f}" if "pcie_bytes_per_token" in row else ""
                plan = f"{row['plan_gpu_bytes'] / 2**30:.2f}" if "plan_gpu_bytes" in row else ""
                lines.append(f"| {row['method']} | {row['ms_per_token']} ({windows}) | {pcie} | "
                             f"{row.get('achieved_h2d_gbps', '')} | {peak:.2f} | {plan} |")
        if s["name"].startswith("prefill") and r.get("ttft_s") is not None:
            peak = f"{r['peak_gpu_bytes'] / 2**30:.2f}" if r.get("peak_gpu_bytes") else "-"
            lines += ["", f"{s['name']}: {r['arch']} {r['dtype']}, {r['profile']}, prompt {r['prompt']}", "",
                      "| context | TTFT s | prefill s | prefill tok/s | H2D GB | D2H GB | peak GPU GiB | plan GiB |",
                      "|---:|---:|---:|---:|---:|---:|---:|---:|",
                      f"| {r['context']} | {r['ttft_s']} | {r['prefill_s']} | {r['prefill_tokens_per_s']} | "
                      f"{r['h2d_bytes'] / 1e9:.2f} | {r['d2h_bytes'] / 1e9:.2f} | {peak} | "
                      f"{r['plan_gpu_bytes'] / 2**30:.2f} |"]
        if s["name"] == "quant-kernels" and r.get("rows"):
            lines += ["", f"block kernels: {r['arch']} projections, {r['dtype']} activations, device copy "
                          f"{r['memory_gbps_measured']} GB/s", "",
                      "| matrix | weights | rows | ms | MB read | GB/s | x floor |", "|---|---|---:|---:|---:|---:|---:|"]
            lines += [f"| {q['matrix']} | {q['weights']} | {q['rows']} | {q['ms']} | {q['weight_bytes'] / 1e6:.1f} | "
                      f"{q['gbps']} | {q['x_floor']} |" for q in r["rows"]]
        if s["name"].startswith("tier-steps") and r.get("rows"):
            lines += ["", f"tier steps: {r['arch']} + {r['draft']}, weights {r.get('quantize', 'none')}, "
                          f"device copy {r['memory_gbps_measured']} GB/s",
                      "", "| attn | context | runner | tier0 ms (x floor) | tier1 ms (x floor) | full ms (x floor) |",
                      "|---|---:|---|---:|---:|---:|"]
            for row in r["rows"]:
                cells = [f"{row.get(f'{t}_ms', float('nan'))} ({row.get(f'{t}_x_floor', '-')})"
                         for t in ("tier0", "tier1", "full")]
                lines.append(f"| {row['attn']} | {row['context']} | {row['runner']} | " + " | ".join(cells) + " |")
    return lines
