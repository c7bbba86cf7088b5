"""`triforce serve --tp 2` (two gloo processes): answers equal a single process's, one request
after another with the cache reused, a client leaving mid-stream stops both ranks in step, and
SIGTERM exits 0; ranks idle past the collective timeout still answer."""
import json
import signal
import subprocess
import sys
import time

import httpx
import pytest

from serve_helpers import DEADLINE_S, start_process as start


def complete(url, prompt, **kw):
    # greedy as `generate --temperature 0`: a request that leaves the penalty out gets the model's
    # default, which for a model that sets none is chat's 1.1 (triforce.model.sampling_defaults)
    body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "repeat_penalty": 1.0, **kw}
    return httpx.post(url + "/completions", json=body, timeout=DEADLINE_S).json()


@pytest.mark.slow
def test_tp_server_answers_as_one_process(tiny_model_dir):
    folder = str(tiny_model_dir("llama-gqa"))
    flags = ["--method", "triforce", "--budget", "24", "--chunk-size", "4"]
    proc, url, lines = start(folder, "--tp", "2", *flags, max_context=None)
    try:
        assert "tensor-parallel over 2 ranks" in lines[-1]
        with httpx.stream("POST", url + "/completions", timeout=DEADLINE_S, json={
                "prompt": "the cat", "max_tokens": 100, "ignore_eos": True, "stream": True}) as response:
            next(response.iter_lines())  # the first piece, then leave: both ranks must stop together
        answers = [complete(url, p) for p in ("the cat sat on the mat", "the cat sat on the mat and the dog")]
        assert answers[1]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # the first one's prefix
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(DEADLINE_S) == 0
    for prompt, answer in zip(("the cat sat on the mat", "the cat sat on the mat and the dog"), answers):
        alone = subprocess.run([sys.executable, "-m", "triforce.cli.main", "generate", "--model", folder,
                                "--prompt", prompt, "--max-new-tokens", "12", "--temperature", "0",
                                "--dtype", "float32", "--method", "ar", "--json"],
                               capture_output=True, text=True, timeout=DEADLINE_S)
        assert answer["choices"][0]["text"] == json.loads(alone.stdout)["text"]


@pytest.mark.slow
def test_tp_server_answers_after_idling_past_the_collective_timeout(tiny_model_dir):
    """Issue 74: the other rank waits for the next request inside a collective, which gives up
    after the process group's timeout (900 s by default, 20 s here: above the ranks' start-up skew
    under load): rank 0 sends heartbeats."""
    folder = str(tiny_model_dir("llama-gqa"))
    proc, url, _ = start(folder, "--tp", "2", "--method", "ar", max_context=None, env={"TRIFORCE_TP_TIMEOUT_S": "20"})
    try:
        first = complete(url, "the cat sat on the mat")
        time.sleep(45)  # idle: more than twice the timeout
        second = complete(url, "the cat sat on the mat")
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(DEADLINE_S) == 0
    assert second["choices"][0]["text"] == first["choices"][0]["text"] != ""
