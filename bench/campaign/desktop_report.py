"""The 2026 desktop's rows in the campaign's report (issue 72): DeepSpeed ZeRO-Inference beside our
rows, and the desktop's goals against llama.cpp on the same file and DeepSpeed on the same shape."""
from __future__ import annotations


def _result(report: dict, step: str) -> dict:
    return next(((s.get("result") or {}) for s in report["steps"] if s["name"] == step), {})


def _method_ms(result: dict, method: str) -> float | None:
    row = next((r for r in result.get("rows", []) if r.get("method") == method and "error" not in r), None)
    return None if row is None else row["ms_per_token"]


def _llamacpp(report: dict, steps: tuple[str, ...], test: str, depth: int) -> list[dict]:
    return [r for name in steps for r in _result(report, name).get("rows", [])
            if r["test"] == test and (r["depth"] if test == "decode" else r["tokens"]) == depth]


def deepspeed_lines(r: dict) -> list[str]:
    """DeepSpeed's prefill and decode at each length, our methods' ms/token beside them."""
    ours = {o["context"]: {row["method"]: row["ms_per_token"] for row in o.get("rows", [])} for o in r.get("ours", [])}
    methods = sorted({m for by in ours.values() for m in by})
    out = ["", f"deepspeed: {r.get('kit')}, {r.get('arch')} random weights, KV offload "
               f"{'on' if r.get('kv_offload') else 'off (no CUDA)'}", "",
           "| context | DeepSpeed prefill s | DeepSpeed ms/token | " + " | ".join(f"ours {m} ms/token" for m in methods)
           + " |", "|---:|---:|---:|" + "---:|" * len(methods)]
    for row in r.get("rows", []):
        mine = ours.get(row["context"], {})
        cells = [f"{mine[m]} ({row['ms_per_token'] / mine[m]:.1f}x)" if mine.get(m) else "-" for m in methods]
        out.append(f"| {row['context']} | {row['prefill_s']} | {row['ms_per_token']} | " + " | ".join(cells) + " |")
    out += [f"- DeepSpeed at {f['context'] or 'start'}: {f['error']}" for f in r.get("failures", [])]
    out += [f"- ours at {o['context']}: {o['error']}" for o in r.get("ours", []) if "error" in o]
    return out


def desktop_goals(report: dict, add) -> None:
    """Issue 72's targets; a target whose steps did not run says so."""
    small, large = _result(report, "desktop-decode-small"), _result(report, "desktop-decode-large")
    long = small.get("context") or 131072
    ours = _method_ms(small, "triforce")
    theirs = _llamacpp(report, ("llamacpp-small",), "decode", long)
    best = min(theirs, key=lambda r: r["ms_per_token"], default=None)
    auto = (small.get("auto_choice") or {}).get("method")
    if ours and best:
        add(f"8B Q4_K_M decode at {long}", f"triforce {ours} ms/token, llama.cpp ({best['kv']} KV) "
            f"{best['ms_per_token']}: {best['ms_per_token'] / ours:.2f}x{f'; auto runs {auto}' if auto else ''}",
            ">= 2.0x llama.cpp", best["ms_per_token"] / ours >= 2.0)
    else:
        add(f"8B Q4_K_M decode at {long}", "not measured (desktop-decode-small or llamacpp-small gave no row)", "", None)
    ttft = _result(report, "desktop-prefill-small")
    filled = _llamacpp(report, ("llamacpp-small",), "prefill", ttft.get("context") or long)
    if ttft.get("ttft_s") is not None and filled:
        add(f"8B Q4_K_M time to first token at {ttft['context']}", f"{ttft['ttft_s']} s against llama.cpp's "
            f"prefill {filled[0]['seconds']} s: {ttft['ttft_s'] / filled[0]['seconds']:.2f}x",
            "<= 1.2x llama.cpp's prefill", ttft["ttft_s"] <= 1.2 * filled[0]["seconds"])
    else:
        add("8B Q4_K_M time to first token", "not measured (desktop-prefill-small or llamacpp-small gave no row)", "",
            None)
    ours = _method_ms(large, "triforce")
    theirs = _llamacpp(report, ("llamacpp-large", "llamacpp-large-fit"), "decode", large.get("context") or 131072)
    best = min(theirs, key=lambda r: r["ms_per_token"], default=None)
    if ours:
        said = (f", llama.cpp's best placement ({best['placement']}) {best['ms_per_token']} ms/token"
                f"{' extrapolated' if best.get('extrapolated_from') else ''}: {best['ms_per_token'] / ours:.2f}x"
                if best else ", llama.cpp not measured")
        add(f"32B Q4_K_M decode at {large['context']}", f"triforce {ours} ms/token{said}",
            "<= 150 ms/token and >= 3x llama.cpp", ours <= 150 and (best is None or best["ms_per_token"] / ours >= 3)
            if best else None)
    else:
        add("32B Q4_K_M decode at 128K", "not measured (desktop-decode-large gave no triforce row)", "", None)
    ds = _result(report, "deepspeed")
    both = [(row, next((o for o in ds.get("ours", []) if o["context"] == row["context"]), {})) for row in ds.get("rows", [])]
    ratios = [(row["context"], row["ms_per_token"] / m, method) for row, o in both for r in o.get("rows", [])
              for method, m in [(r["method"], r["ms_per_token"])] if m]
    if ratios:
        ar = [x for c, x, m in ratios if m == "ar-offload"]
        tri = [x for c, x, m in ratios if m == "triforce"]
        failed = ", ".join(str(f["context"]) for f in ds.get("failures", []) if f.get("context"))
        add("against DeepSpeed ZeRO-Inference", f"ar-offload {min(ar, default=0):.2f}x at worst, triforce "
            f"{min(tri, default=0):.2f}x at worst; DeepSpeed failed at {failed or 'no length'}",
            "ar-offload >= 1.0x and triforce >= 10x wherever both run", bool(ar and tri) and min(ar) >= 1.0
            and min(tri) >= 10)
    else:
        add("against DeepSpeed ZeRO-Inference", "not measured (the deepspeed step gave no row beside ours)", "", None)
