"""The one-command GPU campaign: everything a lent CUDA machine should run, in one call.

    python -m triforce.bench.gpu_campaign [--out-dir bench/results] [--cap-gb 24] [--budget-s 530]
    python -m triforce.bench.gpu_campaign --dry-run      # on any machine: what it would run

Steps (each in its own process, with GPU memory capped to `--cap-gb` so an H100 stands in for a
24 GB card; a failing or overlong step is recorded and the campaign goes on):
  user          what a new user types with default flags (generate greedy and sampled, chat with
                /stats, serve with one openai request) on a random-weight model made on the spot;
                greedy float32 tokens against transformers' generate (its commands are not capped)
  probe         device, versions, exact pinning, pinned host-to-device and device-to-device GB/s
  gpu-tests     pytest tests/gpu (graphs, Triton retrieval, sync counts, offload, sampling, SDPA kernels)
  prefill-32k, prefill-127k  what a user does first: a long prompt (random ids) prefilled through the
                offloaded path, Llama2-7B-128K shapes, 24 GB budget: time to first token, host KV
                bytes moved, peak GPU memory against the plan (bench/prefill_ttft.py)
  tier-steps    tier 0, tier 1 and full-verify step times against their bytes floor, graphs on/off,
                SDPA and flash-attn (when installed), Llama2-7B-128K shapes, random weights
  offload-32k   bench offload, Llama2-7B-128K at 32K: ar-offload, zero-inference, triforce replaying
                an acceptance trace recorded on natural text, and triforce-ahead (the next cycle
                drafted during each verify) beside it
  offload-127k  the same at 127K (130048 tokens: about 62 GiB of pinned host KV)
  offload-127k-best-case  triforce at 127K replaying the needle-in-repeated-filler trace (best case)
  quant-kernels the Triton block kernels (q4_k, q8_0) against bf16 F.linear and the bytes floor, at
                Llama2-7B's projection shapes, 1 and 16 rows
  tier-steps-q4k  tier steps with the target's projections as q4_k blocks (random)
  offload-127k-q4k  bench offload at 127K with q4_k blocks: more of the KV resident
The last three follow the float campaign and may not fit its budget: a second call runs them
(`--only quant-kernels,tier-steps-q4k,offload-127k-q4k`).

Writes gpu-campaign-DATE.json after every step (the commit, torch, driver and device; every step's
command, exit code, seconds, parsed JSON and output tail) and prints the rows for bench/RESULTS.md.
The offload steps write each method's row as it is timed (OUT/STEP.rows.jsonl), so a step cut by
its limit keeps the rows it had."""
from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import click

from triforce.bench.campaign_report import results_rows
from triforce.paths import write_atomically

REPO = Path.cwd()  # the checkout it is run from (tests/ and bench/traces/ are read from there)
# acceptance traces replayed by random-weight architectures: recorded on natural text (what users
# bring), and the best case, a needle in one repeated filler sentence that the model recites
# natural text at the paper's budget 4096 and gamma2 up to 15 (bench offload sizes gamma2 for its acceptance);
# the 32K YaRN trace shows the 135M model reciting itself (0.97 kept) and is not the headline
TRACE = "bench/traces/smollm2-natural8k-b4096-g15-triforce-lookup.json"
BEST_CASE_TRACE = "bench/traces/smollm2-needle8k-repeated-filler-triforce-lookup.json"
ARCH = "llama2-7b-128k"


@dataclass(frozen=True)
class Step:
    name: str
    argv: tuple[str, ...]   # after `python -m triforce.bench.capped --gb CAP --`
    timeout_s: int
    what: str
    streams_rows: bool = False  # `bench offload`: its rows go to OUT/NAME.rows.jsonl as each is timed


def steps(out_dir: Path, quick: bool) -> list[Step]:
    def offload(trace: str) -> tuple[str, ...]:
        return ("-m", "triforce.cli.main", "bench", "offload", "--arch", ARCH, "--profile", "rtx4090-24g",
                "--acceptance-trace", trace, "--new-tokens", "8" if quick else "16", "--dtype", "bfloat16", "--json")
    return [
        Step("user", ("-m", "triforce.bench.user_step", "--json"), 90,
             "a new user's commands with default flags on a random model made here"),
        Step("probe", ("-m", "triforce.bench.gpu_probe"), 60,
             "device, versions, exact pinning, copy bandwidths"),
        Step("gpu-tests", ("-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/gpu", "tests/unit/test_quant_triton.py"),
             150, "GPU tests: graphs == eager, Triton retrieval and block kernels, sync counts, offload, sampling, "
                  "SDPA kernels, quantized decoding"),
        Step("prefill-32k", ("-m", "triforce.bench.prefill_ttft", "--arch", ARCH, "--context", "32768",
                             "--profile", "rtx4090-24g", "--dtype", "bfloat16", "--json"), 120,
             "a 32K prompt prefilled through the offloaded path on a 24 GB budget: time to first token"),
        Step("prefill-127k", ("-m", "triforce.bench.prefill_ttft", "--arch", ARCH, "--context", "130048",
                              "--profile", "rtx4090-24g", "--dtype", "bfloat16", "--json"), 240,
             "a 127K prompt prefilled through the offloaded path on a 24 GB budget: time to first token"),
        Step("tier-steps", ("-m", "triforce.bench.tier_steps", "--arch", ARCH, "--draft", "llama-68m",
                            "--contexts", "4096" if quick else "4096,8192", "--dtype", "bfloat16",
                            "--attn", "sdpa,flash", "--repeats", "10", "--json"), 120,
             "tier step times against their bytes floor"),
        Step("offload-32k", (*offload(TRACE), "--context", "32768", "--plot", str(out_dir / "offload-32k.png"),
                             "--methods", "ar-offload,ar-hybrid,zero-inference,triforce,triforce-ahead,transformers-offloaded"), 170,
             "bench offload at 32K on a 24 GB budget, natural-text trace, transformers' offloaded cache beside", True),
        Step("offload-127k", (*offload(TRACE), "--context", "130048", "--plot", str(out_dir / "offload-127k.png"),
                              "--methods", "ar-offload,ar-hybrid,triforce,triforce-ahead"),
             270, "bench offload at 127K on a 24 GB budget, natural-text trace (zero-inference: 32K only)", True),
        Step("offload-127k-best-case", (*offload(BEST_CASE_TRACE), "--context", "130048", "--methods", "triforce"),
             120, "triforce at 127K replaying the repeated-filler needle trace (a best case)", True),
        Step("quant-kernels", ("-m", "triforce.bench.quant_kernels", "--arch", ARCH, "--rows", "1,16",
                               "--formats", "q4_k,q8_0", "--dtype", "bfloat16", "--json"), 90,
             "Triton block kernels against bf16 F.linear and the bytes floor, Llama2-7B projection shapes"),
        Step("tier-steps-q4k", ("-m", "triforce.bench.tier_steps", "--arch", ARCH, "--draft", "llama-68m",
                                "--contexts", "4096", "--dtype", "bfloat16", "--attn", "sdpa", "--quantize", "q4_k",
                                "--repeats", "10", "--json"), 120,
             "tier step times with q4_k projections against their bytes floor"),
        Step("offload-127k-q4k", (*offload(TRACE), "--context", "130048", "--quantize", "q4_k",
                                  "--methods", "ar-offload,ar-hybrid,triforce"),
             270, "bench offload at 127K with q4_k projections on a 24 GB budget, natural-text trace", True),
    ]


def last_json(text: str):
    for line in reversed(text.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                return None
    return None


def environment(commit: str | None) -> dict:
    """What the numbers were measured with: commit, torch, CUDA driver, device."""
    import torch

    from triforce.bench.provenance import git_commit

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
    cmd = [sys.executable, "-m", "triforce.bench.capped", "--gb", str(cap_gb), "--", *argv]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    started = time.perf_counter()
    record = {"name": step.name, "what": step.what, "command": " ".join(cmd[1:]), "timeout_s": round(timeout_s)}
    try:
        done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s)
        rc, stdout, stderr = done.returncode, done.stdout, done.stderr
    except subprocess.TimeoutExpired as e:
        rc = "timeout"
        stdout = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        stderr = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
    result = last_json(stdout)
    if step.streams_rows and not (result or {}).get("rows"):  # cut by its limit or failed: keep its rows
        result = streamed_result(rows_file)
    record.update(rc=rc, ok=rc == 0, seconds=round(time.perf_counter() - started, 1),
                  result=result, stdout_tail=stdout[-3000:], stderr_tail=stderr[-3000:])
    (log_dir / f"{step.name}.log").write_text(f"$ {record['command']}\n--- stdout\n{stdout}\n--- stderr\n{stderr}")
    return record


@click.command()
@click.option("--out-dir", default="bench/results", show_default=True, help="Where the JSON, logs and plots go.")
@click.option("--cap-gb", type=float, default=24.0, show_default=True, help="GPU memory per process (a 24 GB card).")
@click.option("--budget-s", type=float, default=530.0, show_default=True,
              help="Wall-clock budget for all steps; a step gets what is left, at most its own limit.")
@click.option("--only", default=None, help="Comma-separated step names to run (default: all).")
@click.option("--quick", is_flag=True, help="Fewer tokens and contexts (for a short lease).")
@click.option("--dry-run", is_flag=True, help="Print what would run and exit.")
@click.option("--commit", default=None, help="The commit measured, where the checkout has no .git (default: git's HEAD).")
def main(out_dir, cap_gb, budget_s, only, quick, dry_run, commit):
    """Run the GPU tests and GPU benchmarks in one command, carrying on past failures."""
    out = Path(out_dir).resolve()
    chosen = steps(out, quick)
    if only:
        names = {n.strip() for n in only.split(",")}
        unknown = names - {s.name for s in chosen}
        if unknown:
            raise click.UsageError(f"unknown steps {sorted(unknown)} (choose from {', '.join(s.name for s in chosen)})")
        chosen = [s for s in chosen if s.name in names]
    if dry_run:
        print(f"would run {len(chosen)} steps in {REPO} with GPU memory capped to {cap_gb:g} GB, "
              f"within {budget_s:.0f} s, writing to {out}:")
        for s in chosen:
            print(f"  {s.name:13s} (at most {s.timeout_s} s) {s.what}\n    python -m triforce.bench.capped "
                  f"--gb {cap_gb:g} -- {' '.join(s.argv)}")
        return
    out.mkdir(parents=True, exist_ok=True)
    date = datetime.date.today().isoformat()
    report = {"date": date, "cap_gb": cap_gb, "quick": quick, "environment": environment(commit), "steps": []}
    deadline = time.perf_counter() + budget_s
    path = out / f"gpu-campaign-{date}.json"
    for s in chosen:
        left = deadline - time.perf_counter()
        if left < 10:
            report["steps"].append({"name": s.name, "what": s.what, "rc": "skipped", "ok": False, "seconds": 0,
                                    "result": None, "note": "campaign budget spent"})
            print(f"[{s.name}] skipped: budget spent", flush=True)
            continue
        print(f"[{s.name}] {s.what} (at most {min(s.timeout_s, left):.0f} s) ...", flush=True)
        record = run_step(s, cap_gb, min(s.timeout_s, left), out)
        report["steps"].append(record)
        write_atomically(path, json.dumps(report, indent=1))  # a campaign cut short keeps its finished steps
        print(f"[{s.name}] {'ok' if record['ok'] else 'FAILED rc=' + str(record['rc'])} in {record['seconds']} s",
              flush=True)
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
