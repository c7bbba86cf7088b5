"""The API served on a thread of this process (benchmarks and tests talk to it over the loopback)."""
from __future__ import annotations

import socket
import threading
import time


class BackgroundServer:
    def __init__(self, api, host: str = "127.0.0.1", start_s: float = 300.0):
        import uvicorn

        listener = socket.create_server((host, 0))
        self.url = f"http://{host}:{listener.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(api.app(), log_level="warning"))
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
