"""Nothing measured is lost to a time limit: `bench offload --rows-file` appends each method's row
the moment it is timed, a run killed mid-way keeps the rows it finished, and the GPU campaign
reads them back for a step cut by its limit (and rewrites its report after every step)."""
import json
import subprocess
import sys
import time

from cli_json import run_json
from triforce.bench import gpu_campaign
from triforce.bench.campaign.report import window_lines
from triforce.bench.campaign.work import Fixed

TRACE = "bench/traces/smollm2-natural8k-b4096-g15-triforce-lookup.json"
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
    step = gpu_campaign.Step("decode-127k", "a step that outlives its limit", Fixed(1, "a stand-in"), ("-c", code),
                             streams_rows=True)
    record = gpu_campaign.run_step(step, 24.0, 8, tmp_path)
    assert record["rc"] == "timeout" and not record["ok"] and record["note"] == "cut at its limit of 8 s, keeping the 1 row timed before"
    assert record["result"]["rows"] == [{"method": "ar-offload", "ms_per_token": 812.5}]
    report = {"date": "2026-11-27", "cap_gb": 24.0, "environment": {}, "steps": [record]}
    rows = "\n".join(gpu_campaign.results_rows(report))
    assert "| decode-127k | cut at its limit | " in rows and "cut short" in rows and "| ar-offload | 812.5" in rows
    assert "no probe step in this call (bandwidths not measured)" in rows and "host-to-device ?" not in rows


def test_the_methods_share_one_host_store_and_build_their_variants(capsys, monkeypatch, tmp_path):
    """At 127K each method used to allocate, pin and fill 62 GiB again; now one arena is allocated
    once and every host store borrows it. Each triforce variant builds the cache its name says."""
    from triforce.cache.offloaded import OffloadedKVCache
    from triforce.pinned import host_arena, host_kv_store

    allocated, built = [], []
    for module in (host_arena, host_kv_store):
        real = module.allocate_host
        monkeypatch.setattr(module, "allocate_host",
                            lambda shapes, dtype, real=real, **kw: allocated.append(kw["what"]) or real(shapes, dtype, **kw))
    init = OffloadedKVCache.__init__

    def spy(self, *args, **kwargs):
        built.append((kwargs["hybrid"] is not None, kwargs["decode_resident_tokens"], kwargs["host_arena"] is not None))
        init(self, *args, **kwargs)

    monkeypatch.setattr(OffloadedKVCache, "__init__", spy)
    methods = ["ar-offload", "triforce", "triforce-no-hybrid", "triforce-no-residency", "zero-inference"]
    report = run_json(capsys, "bench", "offload", "--arch", "tiny-test", "--context", "1000", "--device-budget", "4.5MB",
                      "--dtype", "float32", "--draft", "lookup", "--budget", "256", "--new-tokens", "8", "--repeats", "2",
                      "--speculative-tokens", "4", "--acceptance-trace", TRACE, "--methods", ",".join(methods),
                      "--plot", tmp_path / "p.png", "--json")
    assert allocated == ["the shared host KV store"]  # once, for all five
    assert report["host_store"].startswith("shared by the methods")
    assert [r["method"] for r in report["rows"]] == methods and all(r["host_store_shared"] for r in report["rows"])
    by = dict(zip(methods, built))  # zero-inference builds its own kind of cache
    assert all(shared for _, _, shared in built)
    assert by["triforce-no-residency"][1] == 0 and by["triforce"][1] == report["rows"][1]["decode_resident_tokens"]
    hybrid = by["triforce"][0]  # the CPU device keeps no hybrid rates; the variant must not add any either way
    assert by["triforce-no-hybrid"][0] is False and by["ar-offload"][0] is False and by["triforce"][0] is hybrid
    # each timed window's verifies, rebuilds and time by tier (where a slow first window's time went)
    triforce = report["rows"][1]
    assert [p["full_verifies"] > 0 and p["tier_time_s"]["full"] > 0 for p in triforce["window_parts"]] == [True, True]
    lines = "\n".join(window_lines(report["rows"]))
    assert f"- triforce windows: {triforce['ms_per_token_windows'][0]} ms/token: " in lines and " full verifies, " in lines
