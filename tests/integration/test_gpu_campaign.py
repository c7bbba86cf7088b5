"""The GPU campaign fits a lease and loses nothing: its default call, the 2026 desktop's journey,
is estimated under 8 minutes on an H100 (the cost model and the measured one-time costs), --dry-run shows the journey's order
and each step's estimate, a step that does not fit the time left is skipped and said so, and a
reduced run of every step on this CPU streams its rows and ends in the report and the goals."""
import json
import subprocess
import sys
from pathlib import Path

import click
import pytest

from triforce.bench import gpu_campaign
from triforce.bench.campaign.steps import JOURNEY_S, LEASE_S, estimate, plan_total
from triforce.bench.campaign.steps import CAMPAIGN, DECODE_METHODS, DECODE_METHODS_127K, REDUCED, steps
from triforce.bench.campaign.work import Decode, Prefill

JOURNEY = ["probe", "desktop-file-small", "llamacpp-small", "desktop-prefill-small", "desktop-decode-small",
           "desktop-file-large", "llamacpp-large", "desktop-decode-large", "deepspeed", "paper-32k"]
SECOND_CALL = ["prefill-32k", "prefill-127k", "decode-127k", "user", "gpu-tests", "decode-32k", "quant-kernels",
               "quant-tiles", "quant-tests", "decode-127k-q4k", "tier-steps-q4k", "peers-32k", "tier-steps",
               "tp2-one-card", "decode-127k-best-case", "llamacpp-small-q8", "desktop-prefill-small-32k",
               "desktop-decode-small-32k", "llamacpp-large-fit", "desktop-decode-large-64k"]
# the reduced run on a CPU: one step of each command (its twins differ in numbers only, and every
# step's command is parsed at both scales below); each step is an interpreter of its own (~4 s).
# The user step's logic is tested in this process (test_user_step.py): its six processes took 25 s;
# tests/gpu, which gpu-tests runs, is collected (and skipped) by this suite on a CPU
REDUCED_RUN = ["probe", "prefill-127k", "decode-32k", "quant-kernels", "decode-127k-q4k",
               "tier-steps-q4k", "peers-32k"]


def campaign(*flags, timeout=600, cwd=None):
    """The campaign as `triforce bench campaign` where cwd is given (any folder), else its module."""
    command = ["-m", "triforce.cli.main", "bench", "campaign"] if cwd else ["-m", "triforce.bench.gpu_campaign"]
    done = subprocess.run([sys.executable, *command, *flags], capture_output=True, text=True, timeout=timeout, cwd=cwd)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_the_default_call_fits_a_lease_on_an_h100():
    every = steps(Path("out"))
    default = [s for s in every if s.default]
    assert [s.name for s in default] == JOURNEY and [s.name for s in every if not s.default] == SECOND_CALL
    assert plan_total(default, "h100-80g") <= JOURNEY_S < LEASE_S
    by = {s.name: s for s in every}
    for s in every:  # a command is built from the work its estimate prices
        e = estimate(s)
        assert e.seconds > 0 and e.limit_s >= e.seconds and all(v >= 0 for v in e.parts.values())
        if isinstance(s.work, (Decode, Prefill)):
            assert s.argv[s.argv.index("--context") + 1] == str(s.work.context)
        if isinstance(s.work, Decode):  # its plot goes with its rows, never into the checkout
            assert s.argv[s.argv.index("--plot") + 1] == str(Path("out") / f"{s.name}.png")
    assert by["decode-127k"].argv[by["decode-127k"].argv.index("--methods") + 1] == ",".join(DECODE_METHODS_127K)
    assert by["decode-32k"].argv[by["decode-32k"].argv.index("--methods") + 1] == ",".join(DECODE_METHODS)
    assert estimate(by["decode-127k"]).seconds > estimate(by["decode-32k"]).seconds  # 4x the host KV per ar token
    assert estimate(by["prefill-127k"]).parts["prefill compute"] > 4 * estimate(by["prefill-32k"]).parts["prefill compute"]


def test_dry_run_prints_the_journey_with_estimates(tmp_path):
    """From a folder outside the checkout too (issue 77: the traces' paths were relative to it)."""
    out = campaign("--dry-run", cwd=tmp_path)
    listed = [line.split()[:2] for line in out.splitlines() if " ~" in line and "(limit " in line]
    assert [name for mark, name in listed if mark == "run"] == JOURNEY
    assert [words[0] for words in listed if words[0] != "run"] == SECOND_CALL
    assert "--gb 24 -- -m triforce.bench.campaign.user_step --json" in out and "(predicted)" in out
    total = float(out.split("estimated total of the steps to run: ")[1].split(" s")[0])
    assert 0 < total <= JOURNEY_S and f"budget of {LEASE_S} s" in out
    every = steps(Path("out"))
    assert [s.name for s in gpu_campaign.choose(every, None, True)] == JOURNEY + SECOND_CALL  # --all
    assert [s.name for s in gpu_campaign.choose(every, "tier-steps,user", False)] == ["user", "tier-steps"]  # in order


def test_dry_run_shows_each_steps_newest_measured_seconds(tmp_path):
    """Each step's last run comes from the newest report that ran it, by date then start time
    (a name sorting later is not a later run), never from a reduced run on a CPU."""
    def report(name, started, seconds, reduced=False):
        steps = [{"name": step, "seconds": s, "ok": True} for step, s in seconds.items()]
        (tmp_path / name).write_text(json.dumps({"date": "2026-11-28", "started": started, "reduced": reduced,
                                                 "steps": steps}))

    report("gpu-campaign-2026-11-28-h200-abc.json", "2026-11-28T09:10:00+00:00", {"probe": 11.0, "user": 120.0})
    report("gpu-campaign-2026-11-28-h200.json", "2026-11-28T08:00:00+00:00", {"probe": 99.0, "gpu-tests": 150.0})
    report("gpu-campaign-2026-11-29-reduced.json", "2026-11-29T08:00:00+00:00", {"probe": 1.0}, reduced=True)
    out = campaign("--dry-run", "--out-dir", str(tmp_path))
    last = {line.split("~")[0].split()[-1]: line.split("last run ")[1].split(" s")[0] for line in out.splitlines()
            if "last run " in line}
    assert last == {"probe": "11.0", "user": "120.0", "gpu-tests": "150.0"}


def test_a_step_that_does_not_fit_the_time_left_is_skipped_and_said(tmp_path):
    out = campaign("--only", "probe,decode-127k", "--budget-s", "40", "--out-dir", str(tmp_path))
    report = json.loads(next(tmp_path.glob("gpu-campaign-*.json")).read_text())
    probe, decode = report["steps"]
    assert probe["ok"] and decode["rc"] == "skipped" and decode["estimate_s"] > 40
    assert decode["note"].startswith(f"skipped: its estimate of {decode['estimate_s']} s does not fit the ")
    assert f"| decode-127k | skipped | 0 | {decode['estimate_s']} | skipped: its estimate" in out


@pytest.fixture(scope="module")
def reduced(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("campaign")
    stdout = campaign("--reduced", "--only", ",".join(REDUCED_RUN), "--out-dir", str(out_dir), timeout=900)
    report = json.loads((out_dir / next(p.name for p in out_dir.glob("gpu-campaign-*-reduced.json"))).read_text())
    return out_dir, report, {s["name"]: s for s in report["steps"]}, stdout


@pytest.mark.parametrize("scale", [CAMPAIGN, REDUCED], ids=["campaign", "reduced"])
def test_every_step_command_parses_at_head(scale):
    """Each step's command, as the campaign would run it, parsed by its click command (not run)."""
    import importlib

    from triforce.cli.main import cli

    for s in steps(Path("out"), scale):
        assert s.argv[0] == "-m", s.name
        module, args = s.argv[1], list(s.argv[2:])
        if module == "pytest":
            assert all(Path(a).exists() for a in args if a.startswith("tests/")), s.name
            continue
        command = cli if module == "triforce.cli.main" else importlib.import_module(module).main
        if not isinstance(command, click.Command):  # a plain main() takes no flags
            assert args == [], s.name
            continue
        ctx = command.make_context(s.name, args)
        while isinstance(command, click.Group):
            name, command, args = command.resolve_command(ctx, [*ctx._protected_args, *ctx.args])
            ctx = command.make_context(name, args, parent=ctx)


@pytest.mark.slow
def test_a_reduced_run_of_each_kind_of_step_on_a_cpu(reduced):
    out_dir, report, by, stdout = reduced
    assert [s["name"] for s in report["steps"]] == REDUCED_RUN
    assert all(s["ok"] and s["estimate_s"] > 0 for s in report["steps"]), [(s["name"], s["stderr_tail"][-500:])
                                                                          for s in report["steps"] if not s["ok"]]
    for name in ("prefill-127k", "decode-32k", "quant-kernels", "tier-steps-q4k", "peers-32k"):  # what each ran on
        assert {"commit", "date", "machine", "cpu_flags", "torch"} <= set(by[name]["result"]["provenance"]), name
    for name in ("prefill-127k",):  # the prompt's KV went to the host, then decoding followed
        r = by[name]["result"]
        assert r["offloaded"] and r["resident_tokens"] < r["context"] and r["d2h_bytes"] > 0
        assert 0 < r["prefill_s"] <= r["ttft_s"] and r["decode_ms_per_token"] > 0 and len(r["first_token"]) == 1
        assert f"| {r['context']} | {r['ttft_s']} |" in stdout
        # each token after the first timed, the drafts replaying natural text's acceptance
        assert r["replayed"] and len(r["token_gaps_ms"]) == Prefill(0).new_tokens and sum(r["token_gaps_ms"]) > 0
        parts = r["first_token_parts"]
        assert parts["decoding_s"] > 0 and set(parts["tier_time_s"]) >= {"full"} and "first token: " in stdout


@pytest.mark.slow
def test_decode_steps_stream_their_rows_and_share_one_host_store(reduced):
    out_dir, report, by, stdout = reduced
    for name in ("decode-32k",):
        result = by[name]["result"]
        streamed = [json.loads(line) for line in (out_dir / f"{name}.rows.jsonl").read_text().splitlines()]
        assert [line["row"] for line in streamed[1:]] == result["rows"]
        assert [r["method"] for r in result["rows"]] == list(DECODE_METHODS)
        assert all("error" not in r and r["host_store_shared"] and r["host_kv_bytes"] > 0 for r in result["rows"])
        assert result["host_store"].startswith("shared by the methods")
        variants = {r["method"]: r for r in result["rows"]}
        assert variants["triforce-no-hybrid"]["replayed"] and variants["triforce-ahead"]["drafted_ahead"] is not None
        assert "- triforce-no-hybrid windows: " in stdout  # each window's parts (test_campaign_rows.py)
        # the cost model's ms/token on a 4090's link beside each measured row, labelled predicted
        assert all(r["predicted_4090_ms_per_token"] > 0 for r in result["rows"] if r["method"] != "zero-inference")
        assert f"{name}: context " in stdout and "4090 column: predicted by the cost model on rtx4090-24g" in stdout
    peers = {r["method"]: r for r in by["peers-32k"]["result"]["rows"]}
    assert peers["zero-inference"]["ms_per_token"] > 0 and "CUDA only" in peers["transformers-offloaded"]["error"]
    assert "Against the goals:" in stdout and "| CUDA graph fallbacks | 0 | 0 | yes |" in stdout


@pytest.mark.slow
def test_the_block_kernel_steps_make_rows(reduced):
    out_dir, report, by, stdout = reduced
    kernels = {(r["matrix"], r["weights"], r["rows"]): r for r in by["quant-kernels"]["result"]["rows"]}
    assert len(kernels) == 4 * 4 * 2 and all(r["ms"] > 0 and r["x_floor"] > 0 for r in kernels.values())
    for matrix in ("qkv", "o", "gate_up", "down"):  # q4_k on a CPU: 24 bytes per 32 weights against float32's 128
        assert kernels[(matrix, "q4_k", 1)]["weight_bytes"] * 128 == kernels[(matrix, "float", 1)]["weight_bytes"] * 24
    tiers = by["tier-steps-q4k"]["result"]
    assert tiers["quantize"] == "q8_0" and tiers["rows"] and all(r["tier1_ms"] > 0 for r in tiers["rows"])
    assert "| gate_up | q4_k | 16 |" in stdout and "weights q8_0" in stdout and "| q4_k kernel, one row | worst " in stdout and "| q6_k kernel, one row | worst " in stdout


@pytest.mark.slow
def test_the_desktop_steps_run_reduced_on_a_cpu(tmp_path):
    """Issue 72's steps, rehearsed: random Q4_K_M files written, ours on them (a Qwen3 block with
    64-wide heads among them), and llama.cpp's llama-bench on the same files where a build is here."""
    from triforce.bench.campaign.steps import REDUCED

    names = ["desktop-file-small", "desktop-file-large", "desktop-prefill-small", "desktop-decode-small",
             "desktop-decode-large"]
    if Path(REDUCED.desktop.llama_bench).expanduser().is_file():
        names += ["llamacpp-small", "llamacpp-large"]
    if Path(".device-kit/deepspeed/VERSION").is_file():  # bench/build_deepspeed_kit.sh made it here
        names += ["deepspeed"]
    out = campaign("--reduced", "--only", ",".join(names), "--out-dir", str(tmp_path), timeout=900)
    report = json.loads(next(tmp_path.glob("gpu-campaign-*-reduced.json")).read_text())
    by = {s["name"]: s for s in report["steps"]}
    assert all(s["ok"] for s in report["steps"]), [(s["name"], s["stderr_tail"][-500:]) for s in report["steps"]]
    assert by["desktop-file-large"]["result"]["architecture"] == "qwen3"
    assert by["desktop-prefill-small"]["result"]["weights"] != "float"
    for name in ("desktop-decode-small", "desktop-decode-large"):
        rows = by[name]["result"]["rows"]
        assert rows and all("error" not in r and r["ms_per_token"] > 0 for r in rows), rows
        assert f"{name}: context " in out  # its table in the rows for RESULTS.md
    for name in ("llamacpp-small", "llamacpp-large"):
        if name in by:
            assert {r["test"] for r in by[name]["result"]["rows"]} >= {"decode"}
            assert f"{name}: llama.cpp's llama-bench on " in out
    if "llamacpp-large" in by:  # its KV on the host: shallow depths measured, the deep ones on their line
        rows = by["llamacpp-large"]["result"]["rows"]
        assert {r["depth"] for r in rows if r.get("extrapolated_from")} == set(REDUCED.desktop.large_contexts)
        assert "(extrapolated from depths " in out
    if "deepspeed" in by:
        r = by["deepspeed"]["result"]
        assert [row["context"] for row in r["rows"]] == list(REDUCED.desktop.deepspeed_contexts)
        assert [o["context"] for o in r["ours"]] == list(REDUCED.desktop.deepspeed_contexts)
        assert "| against DeepSpeed ZeRO-Inference | ar-offload " in out
