"""Tensor parallelism with two gloo processes on the CPU: sharded logits equal single-process
logits, TP triforce decodes plain greedy's tokens, and a failing rank stops the others."""
import json
import os
import subprocess
import sys
import time

import pytest
import torch

from cli_json import run_json
from tp_helpers import save_logits_rank
from triforce.cache.resident import ResidentKVCache
from triforce.model.loading import load_model
from triforce.errors import UserError
from triforce.app.ranks import launch
from triforce.model.tensor_parallel import even_split

PROMPT = "The capital of France is Paris. The capital of Italy is Rome. The capital of Spain is"


def single_process_logits(model_dir, ids):
    lm = load_model(model_dir, dtype="float64", device="cpu")
    step = ResidentKVCache(lm.config, len(ids), dtype=lm.dtype).step(len(ids))
    return lm.model(torch.tensor([ids]), step.positions, step)


def test_heads_split_as_evenly_as_possible():
    assert even_split(3, 2) == [(0, 2), (2, 1)]
    assert even_split(32, 2) == [(0, 16), (16, 16)]
    with pytest.raises(UserError, match="at most 2"):
        even_split(2, 3)


@pytest.mark.parametrize("family", ["llama-gqa", "qwen2", "qwen3", "llama-mha", "phi3", "phi4-mini", "gemma3",
                                    "gemma3-multimodal"])
def test_tiny_models_tp_logits_equal_single_process(tiny_model_dir, tmp_path, family):
    folder = str(tiny_model_dir(family))
    ids = list(range(3, 30))
    out = tmp_path / "logits.pt"
    launch(2, save_logits_rank, (folder, ids, str(out)))
    got = torch.load(out)
    assert torch.allclose(got["logits"], single_process_logits(folder, ids), atol=1e-10)


def test_default_model_uneven_split_logits_equal_single_process(default_model_dir, tmp_path, default_lm):
    ids = default_lm.tokenizer(PROMPT).input_ids
    out = tmp_path / "logits.pt"
    launch(2, save_logits_rank, (str(default_model_dir), ids, str(out)))
    got = torch.load(out)
    assert got["kv_heads"] == 2  # rank 0 holds 2 of the 3 KV heads, rank 1 the third
    assert torch.allclose(got["logits"], single_process_logits(str(default_model_dir), ids), atol=1e-9)


def cli(*args, env=None, timeout=300):
    return subprocess.run([sys.executable, "-m", "triforce.cli.main", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


@pytest.mark.slow
def test_tp_triforce_greedy_equals_single_process_ar(default_model_dir, capsys):
    common = ["generate", "--prompt", PROMPT, "--dtype", "float64", "--max-new-tokens", "16", "--temperature", "0",
              "--ignore-eos", "--json"]
    ar_out = run_json(capsys, *common, "--method", "ar")  # in this process: one interpreter fewer
    tp = cli(*common, "--method", "triforce", "--draft", "lookup", "--budget", "32", "--tp", "2")
    assert tp.returncode == 0, tp.stderr[-2000:]
    tp_out = json.loads(tp.stdout)
    assert tp_out["tp"] == 2 and tp_out["tokens"] == ar_out["tokens"]


# imported at start-up by every process of a run (the CLI and each spawned rank) through PYTHONPATH:
# rank 1 fails once it has joined the process group, as a rank that runs out of memory would
FAILING_RANK = """
import triforce.app.ranks as ranks

real_join = ranks._join


def join_then_fail(rank, world, port, backend):
    real_join(rank, world, port, backend)
    if rank == 1:
        raise RuntimeError("rank 1 was told to fail (a test)")


ranks._join = join_then_fail
"""


@pytest.mark.slow
def test_a_failing_rank_ends_the_others_with_a_clear_error(tmp_path):
    (tmp_path / "sitecustomize.py").write_text(FAILING_RANK)
    path = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p)
    started = time.monotonic()
    run = cli("generate", "--model", "default", "--prompt", "hi", "--tp", "2", env={"PYTHONPATH": path},
              timeout=120)
    assert run.returncode != 0
    lines = run.stderr.strip().splitlines()
    assert lines[-1].startswith("triforce: error: rank 1 failed") and "told to fail" in lines[-1]
    assert time.monotonic() - started < 120


def test_tp_chat_gives_the_same_answers(tiny_model_dir):
    folder = str(tiny_model_dir("llama-gqa"))
    lines = "the cat sat on the mat\n/reset\nthe dog sat on the log\nand the cat\n"
    # float32 named: the subprocesses do not see conftest's pin of --dtype auto (bf16 on this CPU)
    args = ["-m", "triforce.cli.main", "chat", "--model", folder, "--temperature", "0", "--max-new-tokens", "12",
            "--method", "triforce", "--budget", "24", "--chunk-size", "4", "--dtype", "float32"]
    from click.testing import CliRunner

    from triforce.cli.main import cli as triforce_cli

    alone = CliRunner().invoke(triforce_cli, args[2:], input=lines)  # one process: this one
    alone.returncode = alone.exit_code
    runs = [alone, subprocess.run([sys.executable, *args, "--tp", "2"], input=lines, capture_output=True, text=True,
                                  timeout=300)]
    assert all(run.returncode == 0 for run in runs), (alone.stderr[-2000:], runs[1].stderr[-2000:])
    answers = [[line for line in run.stdout.splitlines() if "[answer cut" in line] for run in runs]  # piped: answers only
    assert len(answers[0]) == 3 and answers[0] == answers[1]
    assert "tensor-parallel over 2 ranks" in runs[1].stderr
    assert all(">>>" not in run.stdout and "triforce chat:" not in run.stdout for run in runs)  # a script's stdout


@pytest.mark.slow
def test_tp_chat_answers_after_idling_past_the_collective_timeout(tiny_model_dir):
    """Issue 74: a follower rank waits for rank 0's next line inside a collective; idle past the
    process group's timeout (900 s by default, 20 s here: above the ranks' start-up skew under load)
    it died, and the next line failed. Rank 0 now sends heartbeats while it waits."""
    folder = str(tiny_model_dir("llama-gqa"))
    args = [sys.executable, "-m", "triforce.cli.main", "chat", "--model", folder, "--temperature", "0",
            "--max-new-tokens", "6", "--method", "ar", "--dtype", "float32", "--tp", "2"]
    chat = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "TRIFORCE_TP_TIMEOUT_S": "20"})
    try:
        chat.stdin.write("the cat sat on the mat\n")
        chat.stdin.flush()
        first = chat.stdout.readline()  # piped: the answer's line, once both ranks decoded it
        time.sleep(45)  # idle: more than twice the collective timeout
        out, err = chat.communicate("the dog sat on the log\n", timeout=120)
    finally:
        chat.kill()
    assert chat.returncode == 0, err[-2000:]
    assert "[answer cut" in first and out.count("[answer cut") == 1, (first, out, err[-2000:])


def test_workers_die_with_their_parent(tmp_path):
    """A killed rank 0 gets no chance to stop its workers: they must notice and end themselves."""
    code = ("import sys; sys.path.insert(0, sys.argv[2]); from tp_helpers import orphan_rank; "
            "from triforce.app.ranks import launch; launch(2, orphan_rank, (sys.argv[1],))")
    tests = os.path.dirname(os.path.dirname(__file__))
    parent = subprocess.run([sys.executable, "-c", code, str(tmp_path), tests], capture_output=True, text=True,
                            timeout=300)
    assert parent.returncode == -9, parent.stderr
    worker = int((tmp_path / "worker.pid").read_text())
    deadline = time.monotonic() + 60  # an upper bound, not a race: it ends within a second or two
    while _alive(worker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(worker)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie has exited already: only its parent's (here: init's) wait is missing
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False
