"""The one-command GPU campaign: everything a lent CUDA machine should run, in one call that fits
a lease (its estimate is held under 8 minutes by a test, within a 9-minute budget).

    python -m triforce.bench.gpu_campaign [--out-dir bench/results] [--cap-gb 24] [--budget-s 540]
    python -m triforce.bench.gpu_campaign --dry-run      # on any machine: the steps and their estimates
    python -m triforce.bench.gpu_campaign --all          # every step (a second call: --only NAMES)
    python -m triforce.bench.gpu_campaign --reduced --out-dir /tmp/c   # every step on a CPU, small shapes

The steps follow a user's journey (bench/campaign/steps.py): the 2026 desktop first (random-weight
Q4_K_M files of Llama-3.1-8B and Qwen3-32B, ours beside llama.cpp's CUDA build on each at 128K,
DeepSpeed ZeRO-Inference beside our offloaded rows, the paper's model at 32K); then, by name or
--all, the paper's prefills and decoding at 32K and 127K, a new user's commands, tests/gpu, the
block kernels, peers, tier steps, the best case and the desktop's other contexts. Each step runs in its
own process with GPU memory capped to `--cap-gb` so an H100 stands in for a 24 GB card; a failing
step is recorded (past its limit, with every thread's stack) and the campaign goes on. Each step's limit
follows from its estimate (bench/campaign/steps.py), and a step whose estimate exceeds the time
left is skipped and said so rather than cut.

Writes gpu-campaign-DATE.json after every step (the commit, torch, driver and device; every step's
command, exit code, seconds, estimate, parsed JSON, output tail, and why it was cut or skipped)
and prints the rows for bench/RESULTS.md with a summary against the goals. The decode steps write
each method's row as it is timed (OUT/STEP.rows.jsonl), so a step cut by its limit keeps the rows
it had."""
from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import click

from triforce.bench.campaign.report import results_rows
from triforce.bench.campaign.stacks import TAIL, communicate, with_stacks
from triforce.bench.campaign.steps import CAMPAIGN, LEASE_S, REDUCED, steps
from triforce.bench.campaign.work import HOME, Step
from triforce.bench.harness import last_json
from triforce.paths import write_atomically

REPO = HOME  # where the steps run: bench/traces/ (and in a checkout tests/) are read from there
STREAMED_SHARE = 1 / 3  # a step that streams its rows starts with this share of its estimate left


def environment(commit: str | None) -> dict:
    """What the numbers were measured with: commit, torch, CUDA driver, device."""
    import torch

    from triforce.bench.harness import git_commit

    env = {"commit": commit or git_commit(REPO), "torch": torch.__version__, "cuda": torch.version.cuda,
           "driver": None, "device": "cpu (no CUDA device)"}
    if torch.cuda.is_available():
        env["device"] = torch.cuda.get_device_name(0)
        try:
            import pynvml
            pynvml.nvmlInit()
            env["driver"] = pynvml.nvmlSystemGetDriverVersion()
            pynvml.nvmlShutdown()
        except Exception as e:  # noqa: BLE001 - recorded, not fatal
            env["driver"] = f"unknown ({type(e).__name__})"
    return env


def streamed_result(rows_file: Path) -> dict | None:
    """What a `bench offload --rows-file` run had measured when it ended: its setting and the rows
    timed so far (None: nothing was written)."""
    if not rows_file.exists():
        return None
    result: dict = {"rows": [], "cut": True}
    for line in rows_file.read_text().splitlines():
        try:
            item = json.loads(line)
        except json.JSONDecodeError:  # a line cut mid-write
            continue
        if "row" in item:
            result["rows"].append(item["row"])
        else:
            result.update(item)
    return result


def run_step(step: Step, cap_gb: float, timeout_s: float, log_dir: Path) -> dict:
    rows_file = log_dir / f"{step.name}.rows.jsonl"
    argv = step.argv
    if step.streams_rows:
        rows_file.unlink(missing_ok=True)
        argv = (*argv, "--rows-file", str(rows_file))
    cmd = [sys.executable, "-m", "triforce.bench.campaign.capped", "--gb", str(cap_gb), "--", *argv]
    env = dict(os.environ, PYTHONUNBUFFERED="1", **dict(step.env))
    started = time.perf_counter()
    record = {"name": step.name, "what": step.what, "command": "".join(f"{k}={v} " for k, v in step.env) + " ".join(cmd[1:]),
              "timeout_s": round(timeout_s)}
    proc = subprocess.Popen(cmd, cwd=REPO, env=with_stacks(env), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    rc, stdout, stderr = communicate(proc, timeout_s)  # past its limit: every thread's stack, then it ends
    result = last_json(stdout)
    if step.streams_rows and not (result or {}).get("rows"):  # cut by its limit or failed: keep its rows
        result = streamed_result(rows_file)
    record.update(rc=rc, ok=rc == 0, seconds=round(time.perf_counter() - started, 1),
                  result=result, stdout_tail=stdout[-3000:], stderr_tail=stderr[-(TAIL if rc == "timeout" else 3000):])
    if rc == "timeout":
        kept = len((result or {}).get("rows", [])) if step.streams_rows else 0
        rows = f", keeping the {kept} row{'' if kept == 1 else 's'} timed before" if step.streams_rows else ""
        record["note"] = f"cut at its limit of {timeout_s:.0f} s{rows}"
    (log_dir / f"{step.name}.log").write_text(f"$ {record['command']}\n--- stdout\n{stdout}\n--- stderr\n{stderr}")
    return record


def choose(chosen_from: list[Step], only: str | None, run_all: bool) -> list[Step]:
    if not only:
        return chosen_from if run_all else [s for s in chosen_from if s.default]
    names = {n.strip() for n in only.split(",")}
    unknown = names - {s.name for s in chosen_from}
    if unknown:
        raise click.UsageError(f"unknown steps {sorted(unknown)} (choose from {', '.join(s.name for s in chosen_from)})")
    return [s for s in chosen_from if s.name in names]


def print_plan(chosen: list[Step], every: list[Step], cap_gb: float, budget_s: float, out: Path, reduced: bool) -> None:
    from triforce.bench.campaign.steps import estimate

    print(f"would run {len(chosen)} steps in {REPO} with GPU memory capped to a {cap_gb:g} GiB card's, within {budget_s:.0f} s, "
          f"writing to {out}{' (reduced shapes, on a CPU)' if reduced else ''}; estimates for an H100 (predicted):")
    last = last_measured(out)
    total = 0.0
    for s in every:
        e = estimate(s, cap_gb=cap_gb)
        mark = "run " if s in chosen else "    "
        if s in chosen:
            total += e.seconds
        parts = ", ".join(f"{k} {v:.0f}" for k, v in e.parts.items())
        seen = f"; last run {last[s.name]} s" if s.name in last else ""
        print(f"  {mark}{s.name:22s} ~{e.seconds:4.0f} s (limit {e.limit_s} s; {parts}; {e.source}{seen})\n"
              f"      {s.what}\n      {''.join(f'{k}={v} ' for k, v in s.env)}python -m triforce.bench.campaign.capped "
              f"--gb {cap_gb:g} -- {' '.join(s.argv)}")
    print(f"estimated total of the steps to run: {total:.0f} s against a budget of {budget_s:.0f} s")


def last_measured(out: Path) -> dict[str, float]:
    """Each step's seconds in the newest GPU campaign report in `out` that ran it (none: {}),
    newest by date, then start time (reports before 2026-11-28's third run have none: then by
    the order git committed them, as a clone's file times are all alike)."""
    dated = []
    for path in out.glob("gpu-campaign-*.json"):
        try:
            report = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if isinstance(report, dict) and not report.get("reduced") and not path.stem.endswith("-reduced"):
            started = str(report.get("started", ""))
            dated.append(((str(report.get("date", "")), started, 0 if started else _committed_at(path)), report))
    seconds = {}
    for _, report in sorted(dated, key=lambda item: item[0]):  # later reports overwrite earlier ones
        seconds.update({s["name"]: s["seconds"] for s in report.get("steps", []) if s.get("ok")})
    return seconds


def _committed_at(path: Path) -> int:
    """When git last committed `path` (0: never, or no git)."""
    try:
        done = subprocess.run(["git", "log", "-1", "--format=%ct", "--", path.name], cwd=path.parent,
                              capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return 0
    return int(done.stdout.strip() or 0) if done.returncode == 0 else 0


@click.command()
@click.option("--out-dir", default="bench/results", show_default=True, help="Where the JSON, logs and plots go.")
@click.option("--cap-gb", type=click.FloatRange(min=1), default=24.0, show_default=True, help="The card each step stands for, in GiB as cards are sold (24: an RTX 4090): PyTorch gets that less the CUDA context.")
@click.option("--budget-s", type=click.FloatRange(min=1), default=float(LEASE_S), show_default=True,
              help="Wall-clock budget for all steps: a step runs when its estimate fits what is left, with at most "
                   "its own limit (a decode step, which keeps its rows, when a third of its estimate is left).")
@click.option("--only", default=None, help="Comma-separated step names to run.")
@click.option("--all", "run_all", is_flag=True, help="Every step, not only the default call's (which fits a lease).")
@click.option("--reduced", is_flag=True, help="Small shapes on any device: every step runs on a CPU in seconds.")
@click.option("--dry-run", is_flag=True, help="Print the steps, their estimates and commands, and exit.")
@click.option("--commit", default=None, help="The commit measured, where the checkout has no .git (default: git's HEAD).")
def main(out_dir, cap_gb, budget_s, only, run_all, reduced, dry_run, commit):
    """Run the GPU tests and GPU benchmarks in one command, carrying on past failures."""
    from triforce.bench.campaign.steps import estimate

    out = Path(out_dir).resolve()
    every = steps(out, REDUCED if reduced else CAMPAIGN)
    chosen = choose(every, only, run_all)
    if dry_run:
        print_plan(chosen, every, cap_gb, budget_s, out, reduced)
        return
    out.mkdir(parents=True, exist_ok=True)
    date = datetime.date.today().isoformat()
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    report = {"date": date, "started": started, "cap_gb": cap_gb, "reduced": reduced, "environment": environment(commit),
              "steps": []}
    deadline = time.perf_counter() + budget_s
    path = out / f"gpu-campaign-{date}{'-reduced' if reduced else ''}.json"
    for s in chosen:
        left = deadline - time.perf_counter()
        e = estimate(s, cap_gb=cap_gb)
        need = 10 if reduced else e.seconds * (STREAMED_SHARE if s.streams_rows else 1.0)
        if left < need:  # the estimates are an H100's: a reduced run only stops when the budget is spent
            note = f"skipped: its estimate of {e.seconds:.0f} s does not fit the {max(left, 0):.0f} s left"
            report["steps"].append({"name": s.name, "what": s.what, "rc": "skipped", "ok": False, "seconds": 0,
                                    "estimate_s": round(e.seconds), "result": None, "note": note})
            write_atomically(path, json.dumps(report, indent=1))
            print(f"[{s.name}] {note}", flush=True)
            continue
        limit = min(600 if reduced else e.limit_s, left)
        print(f"[{s.name}] {s.what} (estimate {e.seconds:.0f} s, at most {limit:.0f} s) ...", flush=True)
        record = run_step(s, cap_gb, limit, out)
        record["estimate_s"] = round(e.seconds)
        report["steps"].append(record)
        write_atomically(path, json.dumps(report, indent=1))  # a campaign cut short keeps its finished steps
        print(f"[{s.name}] {'ok' if record['ok'] else 'FAILED rc=' + str(record['rc'])} in {record['seconds']} s"
              f"{' (' + record['note'] + ')' if record.get('note') else ''}", flush=True)
        if not record["ok"]:
            print("\n".join("    " + line for line in (record["stderr_tail"] or record["stdout_tail"])[-1500:]
                            .splitlines()[-15:]), flush=True)
    probe = next((x["result"] for x in report["steps"] if x["name"] == "probe" and x.get("result")), None)
    report["device_name"] = (probe or {}).get("device_name")
    write_atomically(path, json.dumps(report, indent=1))  # each write whole or not at all
    print(f"\nwrote {path}\n")
    print("\n".join(results_rows(report)))


if __name__ == "__main__":
    main()
