"""A `triforce serve` API on the loopback inside the test process (uvicorn on a thread), and
waiting for its state without racing the clock: every wait is on a condition, with a deadline
only so that a broken server fails instead of hanging."""
import os
import re
import subprocess
import sys
import threading
import time

from triforce.config import RunConfig
from triforce.server.assembly import build_api
from triforce.config import SpecParams
from triforce.server.background import BackgroundServer

DEADLINE_S = 300.0


def wait_for(condition, what: str, deadline_s: float = DEADLINE_S):
    ends = time.monotonic() + deadline_s
    while not (value := condition()):
        if time.monotonic() > ends:
            raise AssertionError(f"gave up waiting for {what}")
        time.sleep(0.01)
    return value


class _GatedQueue:
    """The scheduler's request queue seen through a gate: while closed, the decoding thread waits
    with the request it took, before counting it as started (so it still counts as queued)."""

    def __init__(self, inner):
        self.inner, self.open = inner, threading.Event()
        self.open.set()

    def get(self, block=True, timeout=None):
        job = self.inner.get(block=block, timeout=timeout)  # queue.Empty passes through, as queue's
        self.open.wait()
        return job

    def __getattr__(self, name):
        return getattr(self.inner, name)


class LiveServer:
    def __init__(self, model: str, max_context: int = 2048, batch_size: int = 3, queue_size: int = 8,
                 api_key: str | None = None, method: str = "auto", origins=(), hosts=None,
                 parse_special: bool = False):
        config = RunConfig(model=model, dtype="float32", device="cpu", max_context=max_context,
                           spec=SpecParams(method=method), parse_special_tokens=parse_special)
        self.api, _ = build_api(config, api_key=api_key, batch_size=batch_size, queue_size=queue_size, quiet=True,
                                origins=origins, hosts=hosts)
        self.scheduler = self.api.scheduler
        self._gate = _GatedQueue(self.scheduler._incoming)  # held(): a request taken waits here
        self.scheduler._incoming = self._gate
        self.background = BackgroundServer(self.api, start_s=DEADLINE_S)
        self.url = self.background.url

    def client(self, **kw):
        import openai
        return openai.OpenAI(base_url=self.url + "/v1", api_key=kw.pop("api_key", "none"), max_retries=0,
                             timeout=DEADLINE_S, **kw)

    def idle(self) -> None:
        """Wait until no row decodes (a stream ended by a stop string runs one more round)."""
        wait_for(lambda: self.scheduler.running == 0 and self.scheduler.queued == 0, "the rows to finish")

    def held(self):
        """While held, requests queue up instead of starting; on release they start together."""
        server = self

        class _Held:
            def __enter__(self):
                server._gate.open.clear()

            def __exit__(self, *exc):
                server._gate.open.set()

        return _Held()

    def stop(self) -> None:
        self._gate.open.set()
        self.background.stop(DEADLINE_S)


def start_process(model_dir, *flags, max_context: int | None = 1024, env: dict | None = None):
    """`triforce serve` as a process on a free port: (process, its /v1 URL, the lines it printed);
    `env`: variables added to this process's."""
    context = ["--max-context", str(max_context)] if max_context else []
    proc = subprocess.Popen([sys.executable, "-m", "triforce.cli.main", "serve", "--model", str(model_dir),
                             "--port", "0", "--dtype", "float32", *context, *flags],
                            stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})
    lines = []
    for line in proc.stderr:
        lines.append(line)
        found = re.search(r"listening on (http://\S+/v1)", line)
        if found:
            return proc, found.group(1), lines
    raise AssertionError(f"the server did not start: {''.join(lines)}")
