"""`triforce` as a user types it, run inside the test process: one command, its JSON report."""
import json

import pytest

from triforce.cli.main import main


def run_json(capsys, *args) -> dict:
    """main(args) must exit 0 (its stderr is the failure's message); returns its stdout's JSON."""
    with pytest.raises(SystemExit) as exit_info:
        main([str(a) for a in args])
    out, err = capsys.readouterr()
    assert exit_info.value.code == 0, err
    return json.loads(out)
