"""Ctrl-C stops the test run even inside a test that catches the CLI's exit 130 (interrupt_plugin)."""
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

INNER = textwrap.dedent('''
    import sys, time
    import pytest

    def cli_like():
        """What triforce.cli.main does with Ctrl-C: one line and exit 130."""
        try:
            print("started", flush=True)
            time.sleep(120)
        except KeyboardInterrupt:
            sys.exit(130)

    def test_long():
        with pytest.raises(SystemExit):
            cli_like()

    def test_after():
        print("the run went on", flush=True)
''')


def test_ctrl_c_inside_a_swallowed_exit_ends_the_run(tmp_path):
    (tmp_path / "test_inner.py").write_text(INNER)
    tests_dir = str(Path(__file__).resolve().parent.parent)
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-s", "-p", "interrupt_plugin", "-p",
                             "no:cacheprovider", str(tmp_path / "test_inner.py")],
                            cwd=tmp_path, env={**__import__("os").environ, "PYTHONPATH": tests_dir},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:  # a line, not a clock: the signal goes in once the test is running
        if "started" in line:
            break
    proc.send_signal(signal.SIGINT)
    rest, _ = proc.communicate(timeout=60)
    assert proc.returncode == 2, rest
    assert "interrupted (Ctrl-C)" in rest and "the run went on" not in rest
