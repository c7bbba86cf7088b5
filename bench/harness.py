"""What every benchmark shares, in one place.

Timing: the device synchronized around what is timed, warm-up runs first (compiles, allocations,
first copies), then either the median of separately timed calls (what one call costs: kernels)
or the mean of a back-to-back run (what a step costs when the next is queued behind it, as in
decoding). Provenance: what a measurement ran on (the commit of the checkout, or TRIFORCE_COMMIT
where a copy has no .git, as on a lent GPU machine). Output: a table, one JSON object with the
provenance in it, or CSV rows with the provenance in columns (as llama-bench's)."""
from __future__ import annotations

import csv
import functools
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import click


def sync(device) -> None:
    """Wait for the device's queued work (a no-op on a CPU, where work is done when it returns)."""
    import torch  # here, not above: the CLI imports this module's options before torch is needed

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


@dataclass(frozen=True)
class Timing:
    samples_ms: tuple[float, ...]

    @property
    def median_ms(self) -> float:
        return statistics.median(self.samples_ms)

    @property
    def spread(self) -> float:
        return spread(self.samples_ms)


def spread(samples) -> float:
    """(largest - smallest) / median of times or rates: how far one sample can be trusted."""
    middle = statistics.median(samples)
    return (max(samples) - min(samples)) / middle if middle else 0.0


def each_call(fn, device, repeats: int, warmup: int = 3) -> Timing:
    """Every call timed on its own, the device synchronized before and after each."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        sync(device)
        started = time.perf_counter()
        fn()
        sync(device)
        samples.append((time.perf_counter() - started) * 1e3)
    return Timing(tuple(samples))


GRAPHED_CALLS = 60  # calls per captured graph (each replay's time over this is one call's)


def graphed_ms(call, repeats: int) -> Timing:
    """One call's device time on CUDA: GRAPHED_CALLS calls captured in a CUDA graph, replays timed by
    events (a call timed from the host adds its dispatch, launch and sync: tens of microseconds)."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compiled and allocated before the capture
        for _ in range(3):
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(GRAPHED_CALLS):
            call()
    graph.replay()
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / GRAPHED_CALLS)
    return Timing(tuple(samples))


def back_to_back_ms(fn, device, repeats: int, warmup: int = 3) -> float:
    """The mean of `repeats` calls queued one after another, synchronized once at each end."""
    for _ in range(warmup):
        fn()
    sync(device)
    started = time.perf_counter()
    for _ in range(repeats):
        fn()
    sync(device)
    return (time.perf_counter() - started) * 1e3 / repeats


def git_commit(repo: Path | None = None) -> str:
    """HEAD of the checkout (default: the one this code runs from, an editable install's, from
    any working directory), with '+changes' when tracked files differ from it."""
    if os.environ.get("TRIFORCE_COMMIT"):
        return os.environ["TRIFORCE_COMMIT"]
    try:
        cwd = repo or Path(__file__).resolve().parent
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=cwd,
                               capture_output=True, text=True).stdout.strip()
        return head.stdout.strip() + ("+changes" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown (no git checkout: set TRIFORCE_COMMIT)"


# the CPU features a kernel's speed depends on (the rest of /proc/cpuinfo's flags say nothing here)
VECTOR_FLAGS = frozenset({"sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
                          "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_int8", "asimd", "asimdhp", "sve", "bf16"})


STARTED_AT_COMMIT = "triforce.started_at_commit"  # click's context meta: the commit a `triforce bench` run began at


def remember_commit() -> None:
    """Note the commit now, as a run starts: its code is what it imported, and a commit made while
    it runs (a 26K row takes minutes) must not relabel its results."""
    click.get_current_context().meta[STARTED_AT_COMMIT] = git_commit()


def provenance(repo: Path | None = None) -> dict:
    """What every benchmark's JSON records beside its numbers: the commit (the one the run started
    at, where `triforce bench` noted it), the time (UTC), the machine (CPU model and the cores this
    process may use), its vector flags, torch and the GPU."""
    import datetime
    import platform

    import torch

    from triforce.app.threads import available_cores
    from triforce.kernels.cpu.simd.features import host_flags

    model = platform.processor() or platform.machine()
    try:
        model = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    context = click.get_current_context(silent=True)
    started = context.meta.get(STARTED_AT_COMMIT) if context is not None and repo is None else None
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    return {"commit": started or git_commit(repo), "date": now,
            "machine": f"{model}, {available_cores()} cores", "cpu_flags": sorted(host_flags() & VECTOR_FLAGS),
            "torch": torch.__version__, "cuda": torch.version.cuda, "gpu": gpu, "threads": torch.get_num_threads()}


FORMATS = ("table", "json", "csv")


def output_option(fn):
    """`--format table|json|csv`, and `--json` as its short form: the command receives `fmt`."""
    @functools.wraps(fn)
    def command(*args, fmt: str, as_json: bool, **kwargs):
        return fn(*args, fmt="json" if as_json else fmt, **kwargs)

    command = click.option("--json", "as_json", is_flag=True, help="Same as --format json.")(command)
    return click.option("--format", "fmt", type=click.Choice(FORMATS), default="table", show_default=True,
                        help="table: for reading; json: one object with every row and the provenance; csv: "
                             "one line per row, the provenance in the last columns.")(command)


def emit(fmt: str, summary: dict, rows: list[dict], table=None) -> None:
    """Print the result in `fmt`; `table()` prints the table form (default: the rows as Markdown)."""
    if fmt == "json":
        print(json.dumps({**summary, "rows": rows, "provenance": provenance()}))
    elif fmt == "csv":
        prov = provenance()
        columns = list(dict.fromkeys(key for row in rows for key in row))
        writer = csv.writer(sys.stdout, lineterminator="\n")
        writer.writerow([*columns, "commit", "date", "machine", "torch", "gpu"])
        for row in rows:
            writer.writerow([_cell(row.get(key)) for key in columns]
                            + [prov["commit"], prov["date"], prov["machine"], prov["torch"], prov["gpu"] or ""])
    elif table is not None:
        table()
    else:
        print(markdown(rows))


def last_json(text: str):
    """The last line of a program's output that is a JSON object (None: none, or cut mid-line)."""
    for line in reversed(text.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                return None
    return None


def markdown(rows: list[dict]) -> str:
    """The rows as a Markdown table, numbers right-aligned."""
    columns = list(dict.fromkeys(key for row in rows for key in row))
    lines = ["| " + " | ".join(columns) + " |",
             "|" + "|".join("---:" if all(isinstance(r.get(c), (int, float)) for r in rows) else "---"
                            for c in columns) + "|"]
    lines += ["| " + " | ".join(_cell(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def _cell(value) -> str:
    if value is None:
        return ""
    return json.dumps(value) if isinstance(value, (dict, list, tuple)) else str(value)
