"""A campaign process that outlives its limit says where it hung: its environment turns on
Python's faulthandler, and past the limit it gets SIGABRT, on which faulthandler prints every
thread's stack to stderr before the process ends (a plain kill, as before, left nothing to read:
`triforce serve` on an H200 once never stopped after Ctrl-C, and nothing said where it waited)."""
from __future__ import annotations

import os
import signal
import subprocess

STACKS_S = 15  # for the stacks to be written and the process to end after SIGABRT (then it is killed)
TAIL = 8000    # characters of a hung process's stderr kept: the stacks of a dozen threads


def with_stacks(env: dict | None = None) -> dict:
    """`env` (default: this process's) with faulthandler on in the child."""
    return dict(os.environ if env is None else env, PYTHONFAULTHANDLER="1")


def communicate(proc: subprocess.Popen, timeout_s: float, stdin: str | None = None) -> tuple:
    """(returncode, stdout, stderr) of proc; returncode "timeout" when it ran past timeout_s, its
    stderr then ending with every thread's stack (proc started with env=with_stacks())."""
    try:
        out, err = proc.communicate(stdin, timeout=timeout_s)
        return proc.returncode, out or "", err or ""
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGABRT)
        try:
            out, err = proc.communicate(timeout=STACKS_S)  # retrying loses no output (subprocess docs)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        return "timeout", out or "", err or ""
