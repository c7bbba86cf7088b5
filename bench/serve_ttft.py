"""Time to first token of `triforce serve` over a conversation about a long document: turn 1
(the document prefilled), turn 2 (the next question: the document's KV reused), and turn 2 again
after another conversation took the server's only row (cold: everything prefilled), side by side
in one run. Streamed through the HTTP API on the loopback, as a client sees it.

    python -m triforce.bench.serve_ttft --document-tokens 6000 --max-context 8192
"""
from __future__ import annotations

import json
import time

import click
import httpx

from triforce.config import RunConfig
from triforce.app.texts import prompt_text
from triforce.config import SpecParams


def ask(url: str, messages: list[dict], new_tokens: int) -> dict:
    """One streamed chat request: time to the first text, the answer, and the usage."""
    body = {"messages": messages, "max_tokens": new_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    started = time.perf_counter()
    first, parts, usage = None, [], None
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
            for choice in chunk.get("choices", []):
                if choice["delta"].get("content"):
                    first = first or time.perf_counter()
                    parts.append(choice["delta"]["content"])
    ended = time.perf_counter()
    ttft = (first or ended) - started
    tokens = usage["completion_tokens"]
    return {"ttft_s": round(ttft, 3), "prompt_tokens": usage["prompt_tokens"],
            "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"], "new_tokens": tokens,
            "decode_tok_s": round((tokens - 1) / (ended - first), 2) if first and ended > first and tokens > 1 else None,
            "text": "".join(parts)}


@click.command()
@click.option("--model", default="default", show_default=True)
@click.option("--dtype", default="auto", show_default=True)
@click.option("--method", default="auto", show_default=True)
@click.option("--document-tokens", type=int, default=6000, show_default=True)
@click.option("--max-context", type=int, default=8192, show_default=True)
@click.option("--new-tokens", type=int, default=32, show_default=True)
@click.option("--json", "as_json", is_flag=True)
def main(model, dtype, method, document_tokens, max_context, new_tokens, as_json):
    from triforce.server.assembly import build_api
    from triforce.server.background import BackgroundServer

    config = RunConfig(model=model, dtype=dtype, max_context=max_context, spec=SpecParams(method=method))
    api, lines = build_api(config, batch_size=1, quiet=True)  # one row: another conversation evicts it
    document = prompt_text("natural", api.lm.tokenizer, document_tokens)
    server = BackgroundServer(api)
    try:
        turn1 = [{"role": "user", "content": f"Here is a document:\n\n{document}\n\nSummarise it in one sentence."}]
        runs = {"turn 1": ask(server.url, turn1, new_tokens)}
        turn2 = turn1 + [{"role": "assistant", "content": runs["turn 1"]["text"]},
                         {"role": "user", "content": "Which module does it mention first?"}]
        runs["turn 2"] = ask(server.url, turn2, new_tokens)
        ask(server.url, [{"role": "user", "content": "Something else entirely."}], 4)
        runs["turn 2, cold"] = ask(server.url, turn2, new_tokens)
    finally:
        server.stop()
    from triforce.bench.provenance import provenance

    report = {"model": api.model_id, "dtype": str(api.lm.dtype).removeprefix("torch."), "lines": lines,
              "runs": {k: {f: v for f, v in r.items() if f != "text"} for k, r in runs.items()},
              "turn2_speedup_vs_cold": round(runs["turn 2, cold"]["ttft_s"] / runs["turn 2"]["ttft_s"], 2),
              "provenance": provenance()}
    if as_json:
        print(json.dumps(report))
        return
    print("\n".join(lines[1:]))
    print("| request | prompt tokens | cached | TTFT s | decode tok/s |\n|---|---:|---:|---:|---:|")
    for name, r in runs.items():
        print(f"| {name} | {r['prompt_tokens']} | {r['cached_tokens']} | {r['ttft_s']} | {r['decode_tok_s']} |")
    print(f"turn 2 reaches its first token {report['turn2_speedup_vs_cold']}x sooner than the same request cold")


if __name__ == "__main__":
    main()
