"""Decoding on a shared CPU: tok/s of `triforce generate` quiet and beside busy processes, in one
run, for each way the kernel threads may wait.

    python -m triforce.bench.contention [--busy 1] [--new-tokens 64] [--rounds 2] [--variants ...]

A desktop always runs something else. With every core the kernels' threads can have, one busy
process used to leave decoding at ~0.15x of its quiet speed: threads that spin while they wait
take the cores the others need. Each variant is a set of environment variables for the command
(`default` is what triforce sets itself: sleeping threads; `spin` the old behaviour); every measurement is a separate process, the variants
take turns, and a variant's speed is its best round. Goal: >= 0.5x of quiet with one busy process
on a 2-core machine."""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time

import click

VARIANTS = {
    "default": {},                                 # idle threads sleep (triforce's __init__ sets it)
    "spin": {"TRIFORCE_THREAD_WAIT": "spin"},      # idle threads spin: the old default
    "one-thread": {"TRIFORCE_BENCH_THREADS": "1"},
}
PROMPT = "The capital of France is"


def busy_processes(count: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]


def decode_tok_s(env: dict, new_tokens: int, model: str) -> dict:
    threads = env.get("TRIFORCE_BENCH_THREADS")
    cmd = [sys.executable, "-m", "triforce.cli.main", "generate", "--model", model, "--prompt", PROMPT,
           "--max-new-tokens", str(new_tokens), "--temperature", "0", "--method", "ar", "--ignore-eos", "--json"]
    if threads:
        cmd += ["--threads", threads]
    # this process imported triforce, which set OMP_WAIT_POLICY: each command decides its own
    base = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    done = subprocess.run(cmd, capture_output=True, text=True, env={**base, **env}, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-2000:])
    result = json.loads(done.stdout)
    return {"tok_s": result["tokens_per_s"], "threads": result.get("threads")}


@click.command()
@click.option("--busy", type=int, default=1, show_default=True, help="Busy processes beside the loaded run.")
@click.option("--new-tokens", type=int, default=64, show_default=True)
@click.option("--rounds", type=int, default=2, show_default=True, help="Turns of every variant; the best counts.")
@click.option("--variants", default=",".join(VARIANTS), show_default=True)
@click.option("--model", default="default", show_default=True)
def main(busy: int, new_tokens: int, rounds: int, variants: str, model: str) -> None:
    """Quiet and loaded decode speed per variant (see the module docstring)."""
    chosen = [v.strip() for v in variants.split(",") if v.strip()]
    best: dict = {v: {"quiet": 0.0, "loaded": 0.0} for v in chosen}
    for _ in range(rounds):
        for name in chosen:
            quiet = decode_tok_s(VARIANTS[name], new_tokens, model)
            hogs = busy_processes(busy)
            try:
                time.sleep(0.5)  # the busy processes are running before the load starts
                loaded = decode_tok_s(VARIANTS[name], new_tokens, model)
            finally:
                for hog in hogs:
                    hog.kill()
                    hog.wait()
            best[name]["quiet"] = max(best[name]["quiet"], quiet["tok_s"])
            best[name]["loaded"] = max(best[name]["loaded"], loaded["tok_s"])
            best[name]["threads"] = quiet["threads"]
            print(f"{name}: quiet {quiet['tok_s']} tok/s, with {busy} busy {loaded['tok_s']} tok/s", file=sys.stderr)
    rows = [{"variant": v, "env": VARIANTS[v], **b, "loaded_vs_quiet": round(b["loaded"] / b["quiet"], 3)}
            for v, b in best.items()]
    from triforce.bench.provenance import git_commit

    print(json.dumps({"machine": f"{platform.machine()}, {os.cpu_count()} CPUs", "commit": git_commit(),
                      "date": time.strftime("%Y-%m-%d"), "busy": busy,
                      "new_tokens": new_tokens, "rounds": rounds, "rows": rows}))


if __name__ == "__main__":
    main()
