"""`triforce` as a user types it, run inside the test process: one command, its JSON report; and
Python code run in a fresh interpreter (what importing does to sys.modules)."""
import json
import subprocess
import sys

import pytest

from triforce.cli.main import main


def run_json(capsys, *args) -> dict:
    """main(args) must exit 0 (its stderr is the failure's message); returns its stdout's JSON."""
    with pytest.raises(SystemExit) as exit_info:
        main([str(a) for a in args])
    out, err = capsys.readouterr()
    assert exit_info.value.code == 0, err
    return json.loads(out)


def run_python(code: str) -> str:
    """Run `code` in a fresh interpreter; it must exit 0 (its stderr is the failure's message). Its stdout."""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout
