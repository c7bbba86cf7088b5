"""The GPU campaign's record as rows for bench/RESULTS.md: the steps' outcomes, then a table per
kind of step (the user's commands, prefill and time to first token, offloaded decoding, the
block kernels, tier steps), each from the JSON its step printed or, for a step cut short, wrote
as it went."""
from __future__ import annotations

from triforce.bench.campaign.desktop_report import deepspeed_lines, desktop_goals


def results_rows(report: dict) -> list[str]:
    """Markdown lines for bench/RESULTS.md."""
    probe = next((s["result"] for s in report["steps"] if s["name"] == "probe" and s["result"]), {}) or {}
    env = report.get("environment", {})
    flags = " --reduced" if report.get("reduced") else (" --quick" if report.get("quick") else "")
    lines = [f"GPU campaign {report['date']}, {env.get('device') or probe.get('device_name', 'device unknown')}, "
             f"driver {env.get('driver', '?')}, memory capped to {report['cap_gb']:g} GB, torch "
             f"{env.get('torch') or probe.get('torch', '?')}, commit {env.get('commit', '?')}, "
             + (f"pinned host-to-device {probe.get('pinned_h2d_gbps', '?')} GB/s, device copy "
                f"{probe.get('d2d_gbps', '?')} GB/s" if probe else "no probe step in this call (bandwidths not measured)"),
             "", f"    python -m triforce.bench.gpu_campaign{flags}", "",
             "| step | result | seconds | estimate s | note |", "|---|---|---:|---:|---|"]
    for s in report["steps"]:
        status = {"timeout": "cut at its limit", "skipped": "skipped"}.get(s["rc"], "ok" if s["ok"] else f"failed (exit {s['rc']})")
        lines.append(f"| {s['name']} | {status} | {s['seconds']} | {s.get('estimate_s', '')} | {s.get('note', '')} |")
    lines += goals_rows(report)
    for s in report["steps"]:
        r = s["result"] or {}
        if s["name"] == "user" and r.get("steps"):
            lines += user_lines(r)
        if s["name"].startswith(("offload", "decode", "peers", "desktop-decode", "paper")) and r.get("rows"):
            lines += decode_lines(s["name"], r)
        if s["name"].startswith("llamacpp") and r.get("rows") is not None:
            lines += llamacpp_lines(s["name"], r)
        if s["name"] == "deepspeed" and r.get("peer"):
            lines += deepspeed_lines(r)
        if s["name"].startswith(("prefill", "desktop-prefill")) and r.get("ttft_s") is not None:
            lines += prefill_lines(s["name"], r)
        if s["name"] in ("quant-kernels", "quant-tiles") and r.get("rows"):
            lines += ["", f"block kernels: {r['arch']} projections, {r['dtype']} activations, device copy "
                          f"{r['memory_gbps_measured']} GB/s, {r.get('timing', 'each call on the host clock')}", "",
                      "| matrix | weights | rows | ms | MB read | GB/s | x floor |", "|---|---|---:|---:|---:|---:|---:|"]
            lines += [f"| {q['matrix']} | {q['weights']}{' ' + q['tiles'] if 'tiles' in q else ''} | {q['rows']} | {q['ms']} | {q['weight_bytes'] / 1e6:.1f} | "
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


def _rows(report: dict, step: str) -> dict:
    found = next((s for s in report["steps"] if s["name"] == step), None)
    rows = ((found or {}).get("result") or {}).get("rows") or []
    return {r["method"]: r for r in rows if "error" not in r and "method" in r}


def _result(report: dict, step: str) -> dict:
    return next(((s.get("result") or {}) for s in report["steps"] if s["name"] == step), {})


def user_lines(r: dict) -> list[str]:
    """The user step: each command a new user types, and whether it worked."""
    lines = ["", f"user step on {r['device']} (default dtype {r['default_dtype']}): greedy float32 tokens "
                  f"equal transformers' generate: {r['greedy_float32_equals_transformers']}", "",
              "| command | result | seconds |", "|---|---|---:|"]
    for u in r["steps"]:
        result = "ok" if u["ok"] else f"failed (exit {u.get('rc')}) {u.get('error', '')}".strip()
        if u.get("stopped_s") is not None:  # serve: Ctrl-C to its process group (goal: 2 s)
            result += f", stopped {u['stopped_s']} s after Ctrl-C"
        lines.append(f"| `{u['command'].split(' --model')[0]}` | {result} | {u['seconds']} |")
    return lines


def decode_lines(name: str, r: dict) -> list[str]:
    """A decoding step's table: each method's ms per token, bytes moved and memory."""
    cut = " (cut short: the rows timed before it ended)" if r.get("cut") else ""
    lines = ["", f"{name}: context {r.get('context')}, {r.get('profile')}, pinned H2D "
                  f"{r.get('pinned_h2d_gbps')} GB/s, trace {r.get('replayed_trace')}, host store "
                  f"{r.get('host_store', 'one per method')}{cut}; 4090 column: "
                  f"{r.get('predicted_4090') or 'not predicted'}; "
                  f"{(r.get('auto_choice') or {}).get('said', 'method auto: no choice recorded')}",
              "", "| method | ms/token | PCIe MB/token | H2D GB/s | syncs/token | peak GPU GiB | plan GiB | "
                  "4090 ms/token (predicted) |",
              "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for row in r["rows"]:
        if "error" in row:
            lines.append(f"| {row['method']} | failed or does not fit: {row['error']} | | | | | | |")
            continue
        peak = f"{row['peak_gpu_bytes'] / 2**30:.2f}" if row.get("peak_gpu_bytes") else "-"
        windows = "/".join(str(w) for w in row.get("ms_per_token_windows", []))
        pcie = f"{row['pcie_bytes_per_token'] / 1e6:.1f}" if "pcie_bytes_per_token" in row else ""
        plan = f"{row['plan_gpu_bytes'] / 2**30:.2f}" if "plan_gpu_bytes" in row else ""
        syncs = row.get("syncs_per_token")
        lines.append(f"| {row['method']} | {row['ms_per_token']} ({windows}) | {pcie} | "
                     f"{row.get('achieved_h2d_gbps', '')} | {'' if syncs is None else syncs} | {peak} | {plan} | "
                     f"{row.get('predicted_4090_ms_per_token') or '-'} |")
    lines += window_lines(r["rows"])
    return lines


def prefill_lines(name: str, r: dict) -> list[str]:
    """A prefill step's row: time to first token, bytes moved, memory; where the time went."""
    peak = f"{r['peak_gpu_bytes'] / 2**30:.2f}" if r.get("peak_gpu_bytes") else "-"
    lines = ["", f"{name}: {r['arch']} {r['dtype']} ({r.get('weights', 'float')} weights), {r['profile']}, "
                  f"prompt {r['prompt']}", "",
              "| context | TTFT s | prefill s | prefill tok/s | H2D GB | D2H GB | peak GPU GiB | plan GiB |",
              "|---:|---:|---:|---:|---:|---:|---:|---:|",
              f"| {r['context']} | {r['ttft_s']} | {r['prefill_s']} | {r['prefill_tokens_per_s']} | "
              f"{r['h2d_bytes'] / 1e9:.2f} | {r['d2h_bytes'] / 1e9:.2f} | {peak} | "
              f"{r['plan_gpu_bytes'] / 2**30:.2f} |"]
    if "no_kernel_s" in r:  # under the CUDA profiler: where the prefill's time went
        lines += ["", device_split(r)]
    if r.get("first_token_parts"):  # where an answer's start went
        f, gaps = r["first_token_parts"], r.get("token_gaps_ms") or []
        lines += ["", f"first token: {f['before_decoding_s']} s before its decoding began, {f['decoding_s']} s "
                      f"decoding (by tier {f['tier_time_s']}); the next {len(gaps)} tokens' gaps in ms "
                      f"({'replaying' if r.get('replayed') else 'not replaying'} a trace): "
                      f"{' '.join(str(g) for g in gaps)}"]
    return lines


def goals_rows(report: dict) -> list[str]:
    """The campaign against its goals (the 2026 desktop's of issue 72 first, then issues 52 and 53):
    what was measured, the goal, met or not;
    a goal whose step did not run says so."""
    out = ["", "Against the goals:", "", "| goal | measured | target | met |", "|---|---|---|---|"]

    def add(goal, measured, target, met):
        out.append(f"| {goal} | {measured} | {target} | {'-' if met is None else ('yes' if met else 'NO')} |")

    desktop_goals(report, add)

    rows = _rows(report, "decode-127k")
    tri = min((r for m, r in rows.items() if m.startswith("triforce")), key=lambda r: r["ms_per_token"], default=None)
    if tri is not None and "ar-offload" in rows:
        ar = rows["ar-offload"]["ms_per_token"]
        hybrid = rows.get("ar-hybrid", {}).get("ms_per_token", ar)
        link = _result(report, "decode-127k").get("pinned_h2d_gbps")
        floor = f", {tri['ms_per_token'] / (1000 * tri['pcie_bytes_per_token'] / (link * 1e9)):.2f}x its copy floor" \
            if link and tri.get("pcie_bytes_per_token") else ""
        add("127K decode, best triforce row", f"{tri['method']} {tri['ms_per_token']} ms/token, speed-up {ar / tri['ms_per_token']:.2f}x "
            f"over ar-offload and {hybrid / tri['ms_per_token']:.2f}x over ar-hybrid{floor}",
            "faster than both AR baselines", tri["ms_per_token"] < min(ar, hybrid))
    else:
        add("127K decode, best triforce row", "not measured (decode-127k did not give a triforce and an ar-offload row)", "", None)
    prefill = _result(report, "prefill-127k")
    add("127K time to first token", f"{prefill['ttft_s']} s ({prefill['prefill_tokens_per_s']} tokens/s)"
        if prefill.get("ttft_s") is not None else "not measured", "within 1.5x of a resident flash prefill "
        "(not measured here: 62 GiB of KV and the weights exceed one H100)", None)
    kernels = (_result(report, "quant-kernels").get("rows")) or []
    one = [k for k in kernels if k["weights"] == "q4_k" and k["rows"] == 1 and "tiles" not in k]  # the shipped tiles
    if one:
        for kind in ("q4_k", "q6_k", "q8_0"):
            rows = [k for k in kernels if k["weights"] == kind and k["rows"] == 1 and "tiles" not in k]
            if rows:
                worst = max(rows, key=lambda k: k["x_floor"])
                add(f"{kind} kernel, one row", f"worst {worst['x_floor']}x its bytes floor ({worst['matrix']})",
                    "within 1.5x", worst["x_floor"] <= 1.5)
        ms = {w: sum(k["ms"] for k in kernels if k["weights"] == w and k["rows"] == 16 and "tiles" not in k)
              for w in ("q4_k", "float")}
        if ms["q4_k"] and ms["float"]:
            add("q4_k kernel, 16 rows", f"{ms['q4_k']:.3f} ms against {ms['float']:.3f} ms with float weights (a layer's four)",
                "within 0.6x of the float weights' time (bf16 on a GPU)", ms["q4_k"] <= 0.6 * ms["float"])
    else:
        add("q4_k kernel, one row", "not measured (quant-kernels did not run)", "within 1.5x", None)
    counted = {f"{m} {r['syncs_per_token']}" for step in ("decode-32k", "decode-127k")
               for m, r in _rows(report, step).items() if r.get("syncs_per_token") is not None}
    # ar's allowance: its token, and with the hybrid verify one wait for the host's share (tests/sync_budget.py)
    ar_over = [r["syncs_per_token"] - (2 if m == "ar-hybrid" else 1) for step in ("decode-32k", "decode-127k")
               for m, r in _rows(report, step).items() if m.startswith("ar-") and r.get("syncs_per_token") is not None]
    add("host syncs per token", ", ".join(sorted(counted)) or "not counted (no CUDA decode rows)",
        "ar: one per token (ar-hybrid two: its wait for the host's share); a speculative cycle: a few, never per "
        "layer or per draft (tests/sync_budget.py)", max(ar_over) <= 0.5 if ar_over else None)
    fallbacks = [r.get("graph_fallbacks", 0) for step in ("decode-32k", "decode-127k") for r in _rows(report, step).values()
                 if "graph_fallbacks" in r]
    add("CUDA graph fallbacks", str(sum(fallbacks)) if fallbacks else "not seen (no decode rows)", "0",
        sum(fallbacks) == 0 if fallbacks else None)
    return out


def llamacpp_lines(name: str, r: dict) -> list[str]:
    """llama.cpp's rows (bench/campaign/llamacpp_peer.py): prefill seconds and decode ms per token by
    KV type, placement and depth; what failed (out of memory at a depth is a result) below them."""
    out = ["", f"{name}: llama.cpp's llama-bench on {r['model']}", "",
           "| KV | placement | test | depth | tokens/s | ms/token or s |", "|---|---|---|---:|---:|---:|"]
    out += [f"| {row['kv']} | {row['placement']} | {row['test']} | {row['depth']} | {row['tokens_per_s']} | "
            f"{row.get('ms_per_token', row.get('seconds'))}"
            f"{' (extrapolated from depths ' + ','.join(map(str, row['extrapolated_from'])) + ')' if row.get('extrapolated_from') else ''} |"
            for row in r["rows"]]
    out += [f"- {f['kv']} {f['placement']}: {f['error']}" for f in r.get("failures", [])]
    return out


def window_lines(rows: list[dict]) -> list[str]:
    """Each speculative row's timed windows, part by part: where a slow window's time went."""
    out = []
    for row in rows:
        parts = row.get("window_parts")
        if not parts:
            continue
        said = "; ".join(f"{ms} ms/token: {p['full_verifies']} full verifies, {p['rebuilds']} rebuilds, by tier "
                         + ", ".join(f"{tier} {s} s" for tier, s in p["tier_time_s"].items())
                         for ms, p in zip(row["ms_per_token_windows"], parts))
        out.append(f"- {row['method']} windows: {said}")
    return ["", *out] if out else []


def device_split(r: dict) -> str:
    """A GPU prefill's device time by kind (bench prefill --breakdown's device_seconds)."""
    if not r.get("kernel_kinds_seen"):
        return f"prefill on the device: the profiler recorded no kernel ({r['prefill_s']} s of wall time unsplit)"
    return (f"prefill on the device (profiler, {r['prefill_s']} s of wall time): attention {r['attention_s']} s, "
            f"projections {r['projections_s']} s, other kernels {r['other_kernels_s']} s, no kernel running "
            f"{r['no_kernel_s']} s; copies in {r['copies_h2d_s']} s, out {r['copies_d2h_s']} s")
