"""`triforce serve` as a process: it prints where it listens, SIGTERM lets the stream in flight
finish and exits 0, and bad flags or a port in use are one line before any model loads."""
import json
import signal
import socket
import threading

import httpx
import pytest

from serve_helpers import DEADLINE_S, start_process as start, wait_for
from test_cli import assert_one_line_error, run_cli


def test_sigterm_finishes_the_stream_in_flight_and_exits_0(default_model_dir):
    proc, url, _ = start(default_model_dir, "--batch-size", "1")
    events, first = [], threading.Event()

    def read_stream():
        body = {"prompt": "1, 2, 3, 4, 5,", "max_tokens": 120, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url + "/completions", json=body, timeout=DEADLINE_S) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(line.removeprefix("data: "))
                    first.set()

    reader = threading.Thread(target=read_stream)
    reader.start()
    try:
        assert first.wait(DEADLINE_S)
        proc.send_signal(signal.SIGTERM)
        reader.join(DEADLINE_S)
        assert proc.wait(DEADLINE_S) == 0
    finally:
        proc.kill()
    rest = proc.stderr.read()
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert len([c for c in chunks if c["choices"][0]["text"]]) >= 100  # the whole answer, not cut short
    assert "stopped" in rest and "Traceback" not in rest
    with pytest.raises(httpx.ConnectError):
        httpx.get(url.removesuffix("/v1") + "/health")


def test_health_answers_once_listening(default_model_dir):
    proc, url, lines = start(default_model_dir, "--batch-size", "2", "--model-name", "tiny-chat")
    try:
        health = wait_for(lambda: httpx.get(url.removesuffix("/v1") + "/health").json(), "health")
        assert health["status"] == "ok" and health["model"] == "tiny-chat" and health["batch_size"] == 2
        assert "2 row(s) at once, 1024-token context" in lines[-1]
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(DEADLINE_S) == 0


@pytest.mark.parametrize("flags,fragment", [
    (["--batch-size", "0"], "--batch-size must be >= 1"),
    (["--queue-size", "-1"], "--queue-size must be >= 0"),
    (["--api-key", " "], "--api-key is empty"),
    (["--host", "no.such.host.invalid"], "cannot listen on no.such.host.invalid"),
])
def test_bad_flags_are_one_line(capsys, flags, fragment):
    code, _, err = run_cli(capsys, "serve", "--model", "/nonexistent", *flags)
    assert_one_line_error(code, err, fragment)


def test_a_port_in_use_is_one_line(capsys):
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = str(taken.getsockname()[1])
        code, _, err = run_cli(capsys, "serve", "--model", "/nonexistent", "--port", port)
    assert_one_line_error(code, err, f"cannot listen on 127.0.0.1:{port}")


def test_ctrl_c_in_a_terminal_stops_serve_behind_a_shell_wrapper(default_model_dir):
    """Issue 74: a terminal's Ctrl-C signals the whole foreground process group, a shell that
    started serve included (the H200 campaign signalled one PID behind such a wrapper and serve
    ran on for 30 s). Here the shell stays serve's parent, as `sh -c 'serve; echo'` keeps it."""
    import os
    import shlex
    import subprocess
    import sys
    import time

    command = " ".join(shlex.quote(a) for a in [sys.executable, "-m", "triforce.cli.main", "serve", "--model",
                                                str(default_model_dir), "--port", "0", "--dtype", "float32",
                                                "--max-context", "1024"])
    shell = subprocess.Popen(["sh", "-c", f"{command}; echo wrapper-done"], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        for line in shell.stderr:
            if "listening on" in line:
                break
        else:
            raise AssertionError("serve did not start")
        signalled = time.monotonic()
        os.killpg(shell.pid, signal.SIGINT)  # what the terminal does on Ctrl-C
        shell.wait(DEADLINE_S)
        took = time.monotonic() - signalled
    finally:
        if shell.poll() is None:
            os.killpg(shell.pid, signal.SIGKILL)
    rest = shell.stderr.read()
    assert "triforce serve: stopped" in rest and "Traceback" not in rest, rest[-2000:]
    print(f"stopped {took:.2f} s after Ctrl-C")  # the goal (2 s) is a time: measured, not asserted
