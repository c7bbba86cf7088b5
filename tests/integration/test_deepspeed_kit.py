"""Issue 72: DeepSpeed ZeRO-Inference's wheels, made by bench/build_deepspeed_kit.sh from PyPI and
the transformers fork its KV offload needs, import on a CPU beside this torch: the fork's Llama
carries the kv_offload path, and DeepSpeed its ZeRO-3 inference config; the campaign's peer step
runs them on a CPU (ZeRO stage 3 and the fork's generate, the KV in place), our rows beside. Needs the two public
repositories' clones (a session's fetch): elsewhere skipped."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

MIRRORS = Path(os.environ.get("TRIFORCE_MIRRORS", "/work/.mirror"))
FORK, EXAMPLES = MIRRORS / "tjruwase+transformers" / "repo", MIRRORS / "deepspeedai+DeepSpeedExamples" / "repo"


@pytest.mark.slow
@pytest.mark.skipif(not (FORK.is_dir() and EXAMPLES.is_dir()), reason="the fork's and DeepSpeedExamples' clones are not here")
def test_the_deepspeed_kit_builds_and_imports(tmp_path):
    kit = tmp_path / "kit"
    script = Path(__file__).parents[2] / "bench" / "build_deepspeed_kit.sh"
    built = subprocess.run(["bash", str(script), str(FORK), str(EXAMPLES), str(kit)], capture_output=True, text=True,
                           timeout=900)
    assert built.returncode == 0, built.stderr[-2000:]
    wheels = sorted(p.name.split("-")[0] for p in (kit / "wheels").glob("*.whl"))
    assert wheels == ["deepspeed", "einops", "hjson", "transformers"]
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", str(site),
                    *map(str, (kit / "wheels").glob("*.whl"))], check=True, capture_output=True, timeout=300)
    # what the card's image has and this suite's environment may not (the device README's list)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), "msgpack",
                    "py-cpuinfo"], check=True, capture_output=True, timeout=300)
    code = ("import deepspeed, transformers, inspect\n"
            "from transformers.models.llama import modeling_llama\n"
            "from transformers.deepspeed import HfDeepSpeedConfig\n"
            "assert transformers.__version__ == '4.33.0.dev0', transformers.__version__\n"
            "assert 'kv_offload' in inspect.getsource(modeling_llama)\n"
            "print(deepspeed.__version__)\n")
    ran = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(site)})
    assert ran.returncode == 0 and ran.stdout.strip().splitlines()[-1] == "0.19.8", ran.stderr[-2000:]
    assert (kit / "zero_inference" / "run_model.py").read_text().count("kv_offload") > 0
    peer = subprocess.run([sys.executable, "-m", "triforce.bench.campaign.deepspeed_peer", "--kit", str(kit),
                           "--site", str(tmp_path / "peer-site"), "--reduced", "--arch", "tiny-test",
                           "--contexts", "64,128", "--new-tokens", "4", "--ours", "ar-offload", "--json"],
                          capture_output=True, text=True, timeout=600)
    assert peer.returncode == 0, peer.stderr[-2000:]
    result = json.loads(peer.stdout.strip().splitlines()[-1])
    assert [(r["context"], r["new_tokens"]) for r in result["rows"]] == [(64, 4), (128, 4)] and not result["failures"]
    assert all(r["ms_per_token"] > 0 and r["prefill_s"] > 0 and r["kv_offload"] is False for r in result["rows"])
    assert [[row["method"] for row in o["rows"]] for o in result["ours"]] == [["ar-offload"], ["ar-offload"]]
