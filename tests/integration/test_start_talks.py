"""Issue 75: a start on a terminal is never quiet: each step is named as it begins and its line
counts the seconds until it ends (app.start_steps), here against a stand-in slow step (a model
load that takes 3.5 s) on a stand-in terminal. A pipe gets none of these lines."""
import re
import sys
import threading
import time

import pytest

from triforce.cli.main import main

SLOW_S = 3.5


class Terminal:
    """stderr as a terminal: what was written, and when."""

    def __init__(self):
        self.writes, self._lock = [], threading.Lock()

    def isatty(self):
        return True

    def write(self, text):
        with self._lock:
            self.writes.append((time.monotonic(), text))
        return len(text)

    def flush(self):
        pass

    def text(self):
        return "".join(t for _, t in self.writes)


@pytest.fixture
def slow_load(monkeypatch):
    from triforce.app import runtime

    real, spans = runtime._load, []

    def slow(*args, **kwargs):
        begun = time.monotonic()
        time.sleep(SLOW_S)
        spans.append((begun, time.monotonic()))
        return real(*args, **kwargs)

    monkeypatch.setattr(runtime, "_load", slow)
    return spans


def _generate(folder):
    with pytest.raises(SystemExit) as done:
        main(["generate", "--model", str(folder), "--prompt", "hello", "--max-new-tokens", "2", "--dtype", "float32",
              "--device", "cpu", "--method", "ar"])
    return done.value.code


def test_each_step_is_named_as_it_begins_and_never_quiet_for_2_s(tiny_model_dir, slow_load, monkeypatch, capsys):
    folder = tiny_model_dir("llama-gqa", max_position_embeddings=512)
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert _generate(folder) == 0
    (begun, ended), = slow_load
    text = terminal.text()
    assert "\rstarting ..." in text and "\rloading " in text and "\rloading the compiled CPU kernels" in text
    named = [t for t, w in terminal.writes if w.startswith("\rloading ") and w.rstrip("\x1b[K").endswith("...")]
    assert named and named[0] <= begun + 0.5  # the load was named when it began, not when it ended
    during = [begun] + [t for t, w in terminal.writes if begun < t < ended] + [ended]
    gaps = [b - a for a, b in zip(during, during[1:])]
    assert len(during) >= 4 and max(gaps) <= 2.0, gaps  # "loading ... 1 s", "2 s", "3 s"
    took = [float(m) for m in re.findall(r"\rloading [^\r]*?: (\d+\.\d) s", text)]
    assert took and took[0] >= SLOW_S - 0.1  # its time, said at its end


def test_a_pipe_gets_no_step_lines(tiny_model_dir, capsys):
    folder = tiny_model_dir("llama-gqa", max_position_embeddings=512)
    assert _generate(folder) == 0
    assert "starting ..." not in capsys.readouterr().err
