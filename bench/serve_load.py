"""Throughput of `triforce serve` when clients ask at the same time: N streamed requests sent
together (decoded as rows of one batch) against the same N sent one after another, in one run,
through the HTTP API on the loopback.

    python -m triforce.bench.serve_load --clients 4 --prompt-tokens 1000 --new-tokens 64
"""
from __future__ import annotations

import json
import threading
import time

import click
import httpx

from triforce.config import RunConfig
from triforce.app.texts import natural_ids
from triforce.config import SpecParams


def stream(url: str, prompt: str, new_tokens: int) -> dict:
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": new_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    started = time.perf_counter()
    first = usage = None
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=None) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line.removeprefix("data: "))
                usage = chunk.get("usage") or usage
                if first is None and any(c["delta"].get("content") for c in chunk.get("choices", [])):
                    first = time.perf_counter()
    ended = time.perf_counter()
    return {"tokens": usage["completion_tokens"], "ttft_s": (first or ended) - started, "started": started,
            "ended": ended}


def prompts(tokenizer, clients: int, tokens: int) -> list[str]:
    """Different prose for each client (no shared prefix to reuse)."""
    ids = natural_ids(tokenizer, tokens * clients)
    return [tokenizer.decode(ids[i * tokens:(i + 1) * tokens]) + "\n\nSummarise this." for i in range(clients)]


@click.command()
@click.option("--model", default="default", show_default=True)
@click.option("--dtype", default="auto", show_default=True)
@click.option("--method", default="ar", show_default=True)
@click.option("--clients", type=int, default=4, show_default=True)
@click.option("--prompt-tokens", type=int, default=1000, show_default=True)
@click.option("--new-tokens", type=int, default=64, show_default=True)
@click.option("--max-context", type=int, default=4096, show_default=True)
@click.option("--json", "as_json", is_flag=True)
def main(model, dtype, method, clients, prompt_tokens, new_tokens, max_context, as_json):
    from triforce.server.assembly import build_api
    from triforce.server.background import BackgroundServer

    config = RunConfig(model=model, dtype=dtype, max_context=max_context, spec=SpecParams(method=method))
    api, lines = build_api(config, batch_size=clients, queue_size=clients, quiet=True)
    texts = prompts(api.lm.tokenizer, 2 * clients, prompt_tokens)
    server = BackgroundServer(api)
    try:
        stream(server.url, "Warm up.", 4)
        one_by_one = [stream(server.url, t, new_tokens) for t in texts[:clients]]
        together: list = [None] * clients
        threads = [threading.Thread(target=lambda i=i: together.__setitem__(
            i, stream(server.url, texts[clients + i], new_tokens))) for i in range(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        status = api.scheduler.status()
    finally:
        server.stop()

    def summary(runs):
        tokens = sum(r["tokens"] for r in runs)
        wall = max(r["ended"] for r in runs) - min(r["started"] for r in runs)
        return {"tokens": tokens, "wall_s": round(wall, 3), "tok_s": round(tokens / wall, 2),
                "mean_ttft_s": round(sum(r["ttft_s"] for r in runs) / len(runs), 3)}

    from triforce.bench.provenance import provenance

    report = {"model": api.model_id, "dtype": str(api.lm.dtype).removeprefix("torch."), "clients": clients,
              "prompt_tokens": prompt_tokens, "new_tokens": new_tokens, "method": method,
              "one_by_one": summary(one_by_one), "together": summary(together),
              "rows_per_pass": status["rows_per_pass"], "provenance": provenance()}
    report["throughput_ratio"] = round(report["together"]["tok_s"] / report["one_by_one"]["tok_s"], 2)
    if as_json:
        print(json.dumps(report))
        return
    print("\n".join(lines[1:]))
    print("| requests | tokens | wall s | tok/s | mean TTFT s |\n|---|---:|---:|---:|---:|")
    for name in ("one_by_one", "together"):
        r = report[name]
        print(f"| {clients} {name.replace('_', ' ')} | {r['tokens']} | {r['wall_s']} | {r['tok_s']} | "
              f"{r['mean_ttft_s']} |")
    print(f"together: {report['throughput_ratio']}x the throughput of one by one "
          f"({status['rows_per_pass']} rows per forward pass over the whole run)")


if __name__ == "__main__":
    main()
