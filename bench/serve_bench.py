"""The server as clients see it, through the HTTP API on the loopback, its rows decoding on the
main thread as under `triforce serve` (triforce.server.background.serve_while).

`triforce bench serve-ttft`: time to first token over a conversation about a long document: turn 1
(the document prefilled), turn 2 (the next question: the document's KV reused), and turn 2 again
after another conversation took the server's only row (cold: everything prefilled), side by side
in one run.

`triforce bench serve-load`: throughput when clients ask at the same time: N streamed requests sent
together (decoded as rows of one batch) against the same N sent one after another, in one run.
"""
from __future__ import annotations

import json
import threading
import time

import click
import httpx

from triforce.app.texts import natural_ids, prompt_text
from triforce.bench.harness import emit, markdown, output_option
from triforce.config import RunConfig, SpecParams

def ask(url: str, messages: list[dict], new_tokens: int, **extra) -> dict:
    """One streamed chat request (greedy; `extra`: more body fields): time to the first text, the
    answer, the usage, and when it started and ended (perf_counter)."""
    body = {"messages": messages, "max_tokens": new_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, **extra}
    started = time.perf_counter()
    first, parts, usage, cached = None, [], None, None
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=None) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data: "))
            if "error" in chunk:
                raise click.ClickException(chunk["error"]["message"])
            if chunk.get("usage"):
                usage = chunk["usage"]
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", cached)
            if "cache_n" in chunk.get("timings", {}):  # llama-server's count of the prompt it reused
                cached = chunk["timings"]["cache_n"]
            for choice in chunk.get("choices", []):
                if choice["delta"].get("content"):
                    first = first or time.perf_counter()
                    parts.append(choice["delta"]["content"])
    ended = time.perf_counter()
    ttft = (first or ended) - started
    if usage is None:
        raise click.ClickException(f"{url} sent no usage with its stream")
    tokens = usage["completion_tokens"]
    return {"ttft_s": round(ttft, 3), "prompt_tokens": usage["prompt_tokens"],
            "cached_tokens": cached, "new_tokens": tokens,
            "decode_tok_s": round((tokens - 1) / (ended - first), 2) if first and ended > first and tokens > 1 else None,
            "text": "".join(parts), "started": started, "ended": ended}


OPENING = "Summarise it in one sentence."
FOLLOW_UPS = ("Which module does it mention first?", "What does its last paragraph say?")


def conversation(url: str, document: str, new_tokens: int, follow_ups: int) -> tuple[dict, dict]:
    """Turn 1 asks about the document, each later turn follows the answers so far:
    ({request: ask's result}, {request: its messages})."""
    messages = [{"role": "user", "content": f"Here is a document:\n\n{document}\n\n{OPENING}"}]
    runs, asked = {}, {}
    for turn, question in enumerate(FOLLOW_UPS[:follow_ups], start=1):
        asked[f"turn {turn}"] = messages
        runs[f"turn {turn}"] = ask(url, messages, new_tokens)
        messages = messages + [{"role": "assistant", "content": runs[f"turn {turn}"]["text"]},
                               {"role": "user", "content": question}]
    last = f"turn {follow_ups + 1}"
    asked[last], runs[last] = messages, ask(url, messages, new_tokens)
    return runs, asked


def print_ttft(lines: list[str], rows: list[dict], runs: dict, speedup: float, summary: dict) -> None:
    print("\n".join(lines[1:]))
    print("| server | request | prompt tokens | cached | TTFT s | prefill tok/s | decode tok/s |\n"
          "|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['server']} | {r['request']} | {r['prompt_tokens']} | {r['cached_tokens']} | {r['ttft_s']} | "
              f"{r['prefill_tok_s']} | {r['decode_tok_s']} |")
    against = "the same request cold" if "turn 2, cold" in runs else "turn 1"
    print(f"turn 2 reaches its first token {speedup}x sooner than {against}")
    for k, ratio in summary.get("vs_llama_server", {}).items():
        print(f"{k}: first token {ratio['ttft']}x sooner than llama-server's, decoding {ratio['decode']}x its speed")


@click.command()
@click.option("--model", default="default", show_default=True)
@click.option("--dtype", default="auto", show_default=True)
@click.option("--method", default="auto", show_default=True)
@click.option("--document-tokens", type=click.IntRange(16), default=6000, show_default=True,
              help="Length of the document the conversation is about.")
@click.option("--max-context", type=click.IntRange(64), default=8192, show_default=True)
@click.option("--rope-scaling", default=None, help="Stretch the model to --max-context (e.g. yarn).")
@click.option("--rows", type=click.IntRange(1, 64), default=None,
              help="The server's --batch-size (default: as `triforce serve` sizes it).")
@click.option("--prompt", "prompt_kind", type=click.Choice(["natural", "held-out"]), default="natural",
              show_default=True, help="The document: the shipped corpus, or text no shipped file holds.")
@click.option("--new-tokens", type=click.IntRange(1), default=32, show_default=True, help="Tokens per answer.")
@click.option("--follow-ups", type=click.IntRange(1, len(FOLLOW_UPS)), default=1, show_default=True,
              help="Questions after the first, each in the conversation so far.")
@click.option("--llama-server", "llama_binary", default=None,
              help="llama.cpp's llama-server binary: the same conversation through it, after ours, on --gguf "
                   "with the same context, RoPE stretch and threads (one slot).")
@click.option("--gguf", default=None, help="The GGUF file llama-server loads (default: the shipped file of "
                                           "--model default).")
@output_option
def ttft(model, dtype, method, document_tokens, max_context, rope_scaling, rows, prompt_kind, new_tokens, follow_ups,
         llama_binary, gguf, fmt):
    """The server's time to first token over a conversation about a document: turn 1, the
    follow-ups (the document's KV reused) and turn 2 again after other conversations took every
    row (cold). With --llama-server, the same conversation through llama.cpp's server too."""
    from triforce.app.threads import threads_in_use
    from triforce.server.assembly import build_api
    from triforce.server.background import serve_while

    if gguf is None and llama_binary is not None:
        if model != "default":
            raise click.UsageError("--llama-server needs --gguf: the model's weights as a GGUF file")
        from triforce.model.default_model import ensure_gguf
        gguf = str(ensure_gguf())
    config = RunConfig(model=model, dtype=dtype, max_context=max_context, rope_scaling=rope_scaling,
                       spec=SpecParams(method=method))
    api, lines = build_api(config, batch_size=rows, quiet=True)
    document = prompt_text(prompt_kind, api.lm.tokenizer, document_tokens)

    def ours(url: str) -> dict:
        runs, asked = conversation(url, document, new_tokens, follow_ups)
        if api.scheduler.width == 1:  # another conversation takes the only row: turn 2 again is cold
            ask(url, [{"role": "user", "content": "Something else entirely."}], 4)
            runs["turn 2, cold"] = ask(url, asked["turn 2"], new_tokens)
        return runs

    flags = None  # llama-server's, checked before our conversation runs (minutes at 16K)
    if llama_binary is not None:
        from triforce.bench.llama_server import llama_server, server_flags
        from triforce.model.context_stretch import trained_context
        from triforce.model.hf_config import read_hf_config

        flags = server_flags(gguf, max_context, threads_in_use(), rope_scaling,
                             trained_context(read_hf_config(api.lm.path)))
    runs = serve_while(api, ours)
    peer = {}
    if flags is not None:
        with llama_server(llama_binary, flags) as url:
            peer = conversation(url, document, new_tokens, follow_ups)[0]
    rows = [_row("triforce", k, r) for k, r in runs.items()] + [_row("llama-server", k, r) for k, r in peer.items()]
    # with several rows nothing evicts the document cheaply: turn 1 (the document cold) stands in
    cold = runs.get("turn 2, cold", runs["turn 1"])
    speedup = round(cold["ttft_s"] / runs["turn 2"]["ttft_s"], 2)
    summary = {"model": api.model_id, "dtype": str(api.lm.dtype).removeprefix("torch."), "lines": lines,
               "server_rows": api.scheduler.width, "prompt": prompt_kind, "turn2_speedup_vs_cold": speedup}
    if peer:
        summary["vs_llama_server"] = {k: {"ttft": round(peer[k]["ttft_s"] / runs[k]["ttft_s"], 2),
                                          "decode": _ratio(runs[k]["decode_tok_s"], peer[k]["decode_tok_s"])}
                                      for k in peer}
        summary["llama_server_flags"] = flags

    emit(fmt, summary, rows, lambda: print_ttft(lines, rows, runs, speedup, summary))


def _row(server: str, request: str, run: dict) -> dict:
    fresh = run["prompt_tokens"] - (run["cached_tokens"] or 0)
    return {"server": server, "request": request,
            **{f: v for f, v in run.items() if f not in ("text", "started", "ended")},
            "prefill_tok_s": round(fresh / run["ttft_s"], 1)}


def _ratio(ours, theirs):
    return round(ours / theirs, 2) if ours and theirs else None


def prompts(tokenizer, clients: int, tokens: int) -> list[str]:
    """Different prose for each client (no shared prefix to reuse)."""
    ids = natural_ids(tokenizer, tokens * clients)
    return [tokenizer.decode(ids[i * tokens:(i + 1) * tokens]) + "\n\nSummarise this." for i in range(clients)]


@click.command()
@click.option("--model", default="default", show_default=True)
@click.option("--dtype", default="auto", show_default=True)
@click.option("--method", default="ar", show_default=True)
@click.option("--clients", type=click.IntRange(1, 64), default=4, show_default=True, help="Requests sent at once.")
@click.option("--prompt-tokens", type=click.IntRange(16), default=1000, show_default=True,
              help="Prose per request (a different passage each: no shared prefix to reuse).")
@click.option("--new-tokens", type=click.IntRange(1), default=64, show_default=True)
@click.option("--max-context", type=click.IntRange(64), default=4096, show_default=True)
@output_option
def load(model, dtype, method, clients, prompt_tokens, new_tokens, max_context, fmt):
    """The server's throughput with several clients at once against one by one."""
    from triforce.server.assembly import build_api
    from triforce.server.background import serve_while

    config = RunConfig(model=model, dtype=dtype, max_context=max_context, spec=SpecParams(method=method))
    api, lines = build_api(config, batch_size=clients, queue_size=clients, quiet=True)
    texts = prompts(api.lm.tokenizer, 2 * clients, prompt_tokens)

    def both(url: str) -> tuple[list, list]:
        def stream(text: str, tokens: int) -> dict:
            return ask(url, [{"role": "user", "content": text}], tokens, ignore_eos=True)

        stream("Warm up.", 4)
        one_by_one = [stream(t, new_tokens) for t in texts[:clients]]
        together: list = [None] * clients
        threads = [threading.Thread(target=lambda i=i: together.__setitem__(
            i, stream(texts[clients + i], new_tokens))) for i in range(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return one_by_one, together

    one_by_one, together = serve_while(api, both)
    status = api.scheduler.status()

    def summarised(name, runs):
        tokens = sum(r["new_tokens"] for r in runs)
        wall = max(r["ended"] for r in runs) - min(r["started"] for r in runs)
        return {"requests": f"{clients} {name}", "tokens": tokens, "wall_s": round(wall, 3),
                "tok_s": round(tokens / wall, 2), "mean_ttft_s": round(sum(r["ttft_s"] for r in runs) / len(runs), 3)}

    rows = [summarised("one by one", one_by_one), summarised("together", together)]
    summary = {"model": api.model_id, "dtype": str(api.lm.dtype).removeprefix("torch."), "clients": clients,
               "prompt_tokens": prompt_tokens, "new_tokens": new_tokens, "method": method,
               "rows_per_pass": status["rows_per_pass"], "throughput_ratio": round(rows[1]["tok_s"] / rows[0]["tok_s"], 2)}

    def table():
        print("\n".join(lines[1:]))
        print(markdown(rows))
        print(f"together: {summary['throughput_ratio']}x the throughput of one by one "
              f"({status['rows_per_pass']} rows per forward pass over the whole run)")

    emit(fmt, summary, rows, table)
