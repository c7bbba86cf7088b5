"""Ctrl-C ends a test run even when the code under test swallows it.

The CLI turns Ctrl-C into exit status 130 (one line, no traceback), and the tests call it
in-process inside `pytest.raises(SystemExit)`, so a KeyboardInterrupt raised there became a
failed or passing test and the run went on (two Ctrl-C over 60 s did nothing). Here the SIGINT
is also remembered, and the run stops at the next test boundary."""
from __future__ import annotations

import signal

import pytest

_interrupted = False


def _on_sigint(signum, frame):
    global _interrupted
    _interrupted = True
    raise KeyboardInterrupt


def pytest_configure(config):
    signal.signal(signal.SIGINT, _on_sigint)


def _stop_if_interrupted():
    if _interrupted:
        pytest.exit("interrupted (Ctrl-C)", returncode=2)


def pytest_runtest_setup(item):
    _stop_if_interrupted()


def pytest_runtest_teardown(item, nextitem):
    _stop_if_interrupted()
