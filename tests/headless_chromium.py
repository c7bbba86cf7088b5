"""Debian's Chromium, headless, driven over the DevTools protocol (a websocket per page): enough to
load a page, run a line of JavaScript in it and wait for the DOM to reach a state. No browser is
downloaded: the test is skipped (with its reason) where /usr/bin/chromium is missing, and .ci/run
installs it (apt-get install chromium)."""
from __future__ import annotations

import itertools
import json
import re
import shutil
import subprocess
import tempfile
import time

# flags from the machine notes: closed network, no background connections, root without a sandbox
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--remote-debugging-port=0", "--remote-allow-origins=*"]


def chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


class Browser:
    def __init__(self, deadline_s: float = 60.0):
        import httpx

        # its helper processes may still write there as it ends
        self.profile = tempfile.TemporaryDirectory(prefix="triforce-chromium-", ignore_cleanup_errors=True)
        self.process = subprocess.Popen([chromium(), *FLAGS, f"--user-data-dir={self.profile.name}", "about:blank"],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        ends = time.monotonic() + deadline_s
        for line in self.process.stderr:  # "DevTools listening on ws://127.0.0.1:PORT/devtools/browser/ID"
            found = re.search(r"ws://127\.0\.0\.1:(\d+)/", line)
            if found or time.monotonic() > ends:
                break
        if not found:
            raise RuntimeError("chromium printed no DevTools address")
        target = next(t for t in httpx.get(f"http://127.0.0.1:{found[1]}/json/list").json() if t["type"] == "page")
        from websockets.sync.client import connect
        self.socket = connect(target["webSocketDebuggerUrl"], max_size=None)
        self.ids = itertools.count(1)

    def call(self, method: str, **params) -> dict:
        sent = next(self.ids)
        self.socket.send(json.dumps({"id": sent, "method": method, "params": params}))
        while True:
            message = json.loads(self.socket.recv(timeout=60))
            if message.get("id") == sent:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message["result"]

    def open(self, url: str) -> None:
        self.call("Page.enable")
        self.call("Page.navigate", url=url)
        self.wait("document.readyState === 'complete' && location.href.startsWith(" + json.dumps(url) + ")")

    def js(self, expression: str):
        """The value of a JavaScript expression in the page (awaited where it is a promise)."""
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails'].get('exception', {}).get('description')}")
        return result["result"].get("value")

    def wait(self, condition: str, deadline_s: float = 120.0):
        """Wait until a JavaScript expression is truthy; returns its value."""
        ends = time.monotonic() + deadline_s
        while not (value := self.js(condition)):
            if time.monotonic() > ends:
                raise AssertionError(f"gave up waiting for {condition}")
            time.sleep(0.05)
        return value

    def close(self) -> None:
        try:
            self.socket.close()
        finally:
            self.process.kill()
            self.process.wait()
            self.profile.cleanup()
