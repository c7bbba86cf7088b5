"""Nothing measured is lost to a time limit: `bench offload --rows-file` appends each method's row
the moment it is timed, a run killed mid-way keeps the rows it finished, and the GPU campaign
reads them back for a step cut by its limit (and rewrites its report after every step). And the
campaign's prefill step, reduced to a CPU: a long prompt through the offloaded path, then decoded."""
import json
import subprocess
import sys
import time

from cli_json import run_json
from triforce.bench import gpu_campaign

BENCH = ["bench", "offload", "--arch", "tiny-test", "--context", "600", "--device-budget", "2.5MB", "--new-tokens", "4",
         "--repeats", "1"]


def test_each_row_is_written_as_it_is_timed(capsys, tmp_path):
    rows_file = tmp_path / "rows.jsonl"
    report = run_json(capsys, *BENCH, "--methods", "ar-offload,zero-inference", "--plot", tmp_path / "p.png",
                      "--rows-file", rows_file, "--json")
    lines = [json.loads(line) for line in rows_file.read_text().splitlines()]
    assert lines[0]["bench"] == "offload" and lines[0]["context"] == 600  # the setting, before any timing
    assert [line["row"] for line in lines[1:]] == report["rows"]  # stdout stays one JSON object


def test_a_run_killed_mid_way_keeps_its_finished_rows(tmp_path):
    rows_file = tmp_path / "rows.jsonl"
    cmd = [sys.executable, "-m", "triforce.cli.main", *BENCH, "--methods", "ar-offload,zero-inference,ar-offload",
           "--plot", str(tmp_path / "p.png"), "--rows-file", str(rows_file), "--json"]
    child = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300  # a deadline only so that a broken run fails instead of hanging
    try:
        while child.poll() is None and time.monotonic() < deadline:
            if rows_file.exists() and len(rows_file.read_text().splitlines()) >= 2:  # the setting and a row
                child.kill()
                break
            time.sleep(0.05)
    finally:
        child.kill()
        child.wait()
    kept = gpu_campaign.streamed_result(rows_file)
    assert kept["cut"] and kept["context"] == 600
    assert kept["rows"] and kept["rows"][0]["method"] == "ar-offload" and kept["rows"][0]["ms_per_token"] > 0


def test_a_step_cut_by_its_limit_keeps_the_rows_it_wrote(tmp_path):
    """A stand-in for bench offload that writes its setting and one row, then outlives its limit."""
    code = ("import json, sys, time\n"
            "f = open(sys.argv[-1], 'a')\n"
            "f.write(json.dumps({'bench': 'offload', 'context': 130048, 'profile': 'rtx4090-24g', "
            "'pinned_h2d_gbps': 25.0}) + '\\n')\n"
            "f.write(json.dumps({'row': {'method': 'ar-offload', 'ms_per_token': 812.5}}) + '\\n')\n"
            "f.close()\n"
            "time.sleep(600)\n")
    step = gpu_campaign.Step("offload-127k", ("-c", code), 20, "a step that outlives its limit", streams_rows=True)
    record = gpu_campaign.run_step(step, 24.0, 20, tmp_path)
    assert record["rc"] == "timeout" and not record["ok"]
    assert record["result"]["rows"] == [{"method": "ar-offload", "ms_per_token": 812.5}]
    report = {"date": "2026-11-27", "cap_gb": 24.0, "quick": False, "environment": {}, "steps": [record]}
    rows = "\n".join(gpu_campaign.results_rows(report))
    assert "| offload-127k | timed out |" in rows and "cut short" in rows and "| ar-offload | 812.5" in rows


def test_a_long_prompt_prefills_through_the_offloaded_path(tmp_path):
    done = subprocess.run([sys.executable, "-m", "triforce.bench.prefill_ttft", "--arch", "tiny-test", "--context", "600",
                           "--device-budget", "3.4MB", "--dtype", "float32", "--new-tokens", "4", "--json"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    r = json.loads(done.stdout)
    assert r["offloaded"] and r["resident_tokens"] < 600 and r["d2h_bytes"] > 0  # the prompt's KV went to the host
    assert 0 < r["prefill_s"] <= r["ttft_s"] and r["decode_ms_per_token"] > 0 and len(r["first_token"]) == 1
    record = {"name": "prefill-32k", "rc": 0, "ok": True, "seconds": 1.0, "result": r}
    report = {"date": "2026-11-27", "cap_gb": 24.0, "quick": False, "environment": {}, "steps": [record]}
    assert f"| 600 | {r['ttft_s']} |" in "\n".join(gpu_campaign.results_rows(report))
