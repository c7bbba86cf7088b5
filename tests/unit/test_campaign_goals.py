"""The campaign's table against the goals, read from the H200 report of 2026-11-28: ar-hybrid's
two syncs a token (its token, and its wait for the host's share, which tests/sync_budget.py
allows) met the goal there, and was judged against plain ar's one."""
import copy
import json
from pathlib import Path

from triforce.bench.campaign.report import goals_rows

REPORT = json.loads((Path(__file__).parents[2] / "bench/results/gpu-campaign-2026-11-28-h200.json").read_text())


def sync_goal(report: dict) -> str:
    (row,) = [r for r in goals_rows(report) if r.startswith("| host syncs per token")]
    return row.rsplit("|", 2)[-2].strip()


def test_ar_hybrids_wait_for_the_host_share_is_within_the_goal():
    assert sync_goal(REPORT) == "yes"


def test_a_second_sync_in_plain_ar_misses_the_goal():
    doctored = copy.deepcopy(REPORT)
    for step in doctored["steps"]:
        for row in (step.get("result") or {}).get("rows", []):
            if row["method"] == "ar-offload":
                row["syncs_per_token"] = 2.0
    assert sync_goal(doctored) == "NO"
