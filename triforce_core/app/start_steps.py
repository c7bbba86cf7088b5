"""The steps of a start, told on a terminal as they begin so that a start is never quiet: a line
names the step and counts its seconds, rewritten every TICK_S, until it ends with its time.
Steps follow one another: a step begun ends the one before. Only a command that loads a model,
run on a terminal, talks (cli.main turns it on when stderr is one): a pipe, a log or the Python
API gets nothing from here (the compile steps still say their times there, once)."""
from __future__ import annotations

import sys
import threading
import time
from contextlib import contextmanager

TICK_S = 1.0  # a line at least this often while a step runs (the bound: 2 s)
CLEAR = "\x1b[K"  # erase to the end of the line: a shorter line over a longer one


class StartSteps:
    def __init__(self, stream, tick_s: float = TICK_S):
        self.stream, self.tick_s = stream, tick_s
        self._lock = threading.Lock()
        self._current: tuple[str, float, threading.Event, threading.Thread] | None = None

    def begin(self, name: str) -> None:
        """`name` starts now (the step before it ends)."""
        self.end()
        started, done = time.perf_counter(), threading.Event()

        def tick() -> None:
            while not done.wait(self.tick_s):
                self._line(f"{name} ... {time.perf_counter() - started:.0f} s")

        self._line(f"{name} ...")
        ticker = threading.Thread(target=tick, name="start-steps", daemon=True)
        self._current = (name, started, done, ticker)
        ticker.start()

    def end(self) -> None:
        """The running step (if any) ends: its line says its time."""
        if self._current is None:
            return
        name, started, done, ticker = self._current
        self._current = None
        done.set()
        ticker.join()
        self._line(f"{name}: {time.perf_counter() - started:.1f} s", "\n")

    def run(self, name: str, work):
        """work() as a step of its own; its result."""
        with self.step(name):
            return work()

    @contextmanager
    def step(self, name: str):
        self.begin(name)
        try:
            yield
        finally:
            self.end()

    def _line(self, text: str, end: str = "") -> None:
        with self._lock:
            self.stream.write(f"\r{text}{CLEAR}{end}")
            self.stream.flush()


_ACTIVE: StartSteps | None = None
LOADING_COMMANDS = ("chat", "generate", "serve")  # the commands whose start loads a model


def talk_on(stream) -> StartSteps | None:
    """Steps from now on are told on `stream` (a terminal); None: told nowhere (a running step ends)."""
    global _ACTIVE
    if _ACTIVE is not None:
        _ACTIVE.end()
    _ACTIVE = None if stream is None else StartSteps(stream)
    return _ACTIVE


def active() -> StartSteps | None:
    return _ACTIVE


@contextmanager
def start_step(name: str, rank: int = 0):
    """A step of a start: told on the terminal where talk_on set one (rank 0 only), else silent."""
    if _ACTIVE is None or rank != 0:
        yield
        return
    with _ACTIVE.step(name):
        yield


def starting(argv: list[str], stream=None) -> None:
    """cli.main's call: a command that loads a model, on a terminal, names its steps from here on,
    the first ("starting": Python's imports of torch and the rest) at once."""
    stream = stream or sys.stderr
    if argv[:1] and argv[0] in LOADING_COMMANDS and "--help" not in argv and "-h" not in argv and stream.isatty():
        talk_on(stream).begin("starting")
    else:
        talk_on(None)
