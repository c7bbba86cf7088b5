"""The API served on a thread of this process (benchmarks and tests talk to it over the loopback)."""
from __future__ import annotations

import socket
import threading
import time
from typing import Callable, TypeVar

T = TypeVar("T")


def _loopback_server(api, host: str):
    """(a listening socket on a free port, its URL, a uvicorn server for `api` not yet started)."""
    import uvicorn

    listener = socket.create_server((host, 0))
    return listener, f"http://{host}:{listener.getsockname()[1]}", \
        uvicorn.Server(uvicorn.Config(api.app(), log_level="warning"))


class BackgroundServer:
    """The HTTP server and the rows' decoding on threads of their own: for tests, which drive the
    server from this thread (a row decodes there at half the speed of `triforce serve`'s, see
    Scheduler.serve_here; benchmarks use serve_while)."""

    def __init__(self, api, host: str = "127.0.0.1", start_s: float = 300.0):
        listener, self.url, self.server = _loopback_server(api, host)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [listener]}, daemon=True)
        self.thread.start()
        ends = time.monotonic() + start_s
        while not self.server.started:  # a condition, with a deadline only against a broken start
            if time.monotonic() > ends or not self.thread.is_alive():
                raise RuntimeError("the server did not start")
            time.sleep(0.01)

    def stop(self, wait_s: float = 300.0) -> None:
        self.server.should_exit = True
        self.thread.join(wait_s)


def serve_while(api, work: Callable[[str], T], host: str = "127.0.0.1") -> T:
    """Serve `api` on the loopback while work(url) runs on a thread, the rows decoding on this
    thread as under `triforce serve` (Scheduler.serve_here), so that a benchmark times what users
    get; then stop. Returns what work returned (what it raised is raised here)."""
    listener, url, server = _loopback_server(api, host)
    outcome: dict = {}
    served = threading.Event()

    def client() -> None:
        try:
            while not server.started:
                if served.is_set():
                    raise RuntimeError("the server did not start")
                time.sleep(0.01)
            outcome["result"] = work(url)
        except BaseException as e:  # noqa: BLE001 - raised on the calling thread
            outcome["error"] = e
        finally:
            server.should_exit = True

    thread = threading.Thread(target=client, name="triforce-bench-client")
    thread.start()
    try:
        api.scheduler.serve_here(lambda: server.run(sockets=[listener]))
    finally:
        served.set()
        thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]
