"""What `generate --prompts` costs as the prompts file grows: peak resident memory of the run and
the time to its first printed result, for files of N short prompts (lines of the shipped natural
prose), --new-tokens each (default 1).

    python -m triforce.bench.prompts_stream --counts 1000,4000 [--new-tokens 1] [--model default] [--json]

Each run is a `triforce generate --prompts` process of its own, its resident memory sampled every
50 ms. Memory that stays flat as N grows is the point: the file is read a line at a time and
only the rows in flight are held."""
from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from importlib import resources
from pathlib import Path

import click
import psutil


def write_prompts(path: Path, count: int) -> None:
    """count prompts: consecutive lines of the natural prose corpus, cut to 12 words."""
    text = gzip.decompress(resources.files("triforce.app").joinpath("natural_prose.txt.gz").read_bytes()).decode()
    lines = [" ".join(line.split()[:12]) for line in text.splitlines() if len(line.split()) >= 6]
    with open(path, "w", encoding="utf-8") as f:
        for i in range(count):
            f.write(json.dumps({"prompt": lines[i % len(lines)]}) + "\n")


def run_once(model: str, count: int, folder: Path, new_tokens: int) -> dict:
    path = folder / f"prompts-{count}.jsonl"
    write_prompts(path, count)
    command = [sys.executable, "-m", "triforce.cli.main", "generate", "--model", model, "--prompts", str(path),
               "--max-new-tokens", str(new_tokens), "--method", "ar"]
    started = time.perf_counter()
    first = None
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    peak = [0]

    def watch():  # the child's resident memory, sampled every 50 ms
        child = psutil.Process(proc.pid)
        while proc.poll() is None:
            try:
                peak[0] = max(peak[0], child.memory_info().rss)
            except psutil.Error:
                return
            time.sleep(0.05)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    results = 0
    for line in proc.stdout:
        if line.startswith("=== prompt"):
            results += 1
            if first is None:
                first = time.perf_counter() - started
    proc.wait()
    watcher.join()
    return {"prompts": count, "file_bytes": path.stat().st_size, "exit": proc.returncode, "results": results,
            "first_result_s": round(first, 2) if first is not None else None,
            "total_s": round(time.perf_counter() - started, 1), "peak_rss_mib": round(peak[0] / 2**20, 1)}


@click.command()
@click.option("--counts", default="1000,4000", show_default=True,
              help="Prompt counts, comma-separated.")
@click.option("--model", default="default", show_default=True)
@click.option("--new-tokens", type=int, default=1, show_default=True, help="--max-new-tokens of each run.")
@click.option("--json", "as_json", is_flag=True)
def main(counts: str, model: str, new_tokens: int, as_json: bool) -> None:
    """Print peak memory and time to the first result of `generate --prompts` for each count."""
    sizes = sorted(int(c) for c in counts.split(","))
    with tempfile.TemporaryDirectory() as folder:
        rows = [run_once(model, n, Path(folder), new_tokens) for n in sizes]
    if as_json:
        print(json.dumps({"cpu": os.uname().machine, "rows": rows}))
        return
    print("| prompts | file bytes | results | first result s | total s | peak RSS MiB |")
    print("|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['prompts']} | {r['file_bytes']} | {r['results']} | {r['first_result_s']} | {r['total_s']} | "
              f"{r['peak_rss_mib']} |")


if __name__ == "__main__":
    main()
