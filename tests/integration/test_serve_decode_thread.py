"""`triforce serve` and the server benchmarks decode rows on the thread that runs them (the
process's first thread), not on a thread of their own: OpenMP throttles its workers' spinning
under any other thread, which halved a row's decoding speed (Scheduler.serve_here)."""
import os
import signal
import socket
import threading

import httpx
import pytest

from serve_helpers import wait_for
from triforce.config import RunConfig, SpecParams
from triforce.server import assembly, scheduler
from triforce.server.assembly import build_api
from triforce.server.background import serve_while


def _spy_on_rows(monkeypatch) -> list[int]:
    """The threads each request decoded on, in order."""
    seen = []
    serve_request = scheduler.Scheduler.serve_request

    def spied(self, job, lane=None):
        seen.append(threading.get_ident())
        return serve_request(self, job, lane)

    monkeypatch.setattr(scheduler.Scheduler, "serve_request", spied)
    return seen


def _config(model) -> RunConfig:
    return RunConfig(model=str(model), dtype="float32", device="cpu", max_context=128, spec=SpecParams(method="auto"))


def _complete(url: str) -> str:
    body = {"prompt": "the cat sat on", "max_tokens": 4, "temperature": 0}
    reply = httpx.post(url + "/v1/completions", json=body, timeout=300)
    reply.raise_for_status()
    return reply.json()["choices"][0]["text"]


def test_triforce_serve_decodes_on_its_main_thread_and_stops_on_sigterm(tiny_model_dir, monkeypatch):
    seen = _spy_on_rows(monkeypatch)
    listener = socket.create_server(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    answers = []

    def client() -> None:
        try:
            wait_for(lambda: _healthy(url), "the server to listen")
            answers.append(_complete(url))
        finally:  # whatever happened, the server must stop
            os.kill(os.getpid(), signal.SIGTERM)

    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    thread = threading.Thread(target=client)
    thread.start()
    try:
        assembly.run_server(_config(tiny_model_dir("llama-gqa")), listener, None, None, 2, 4, quiet=True)
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
        thread.join()
    assert len(answers) == 1 and seen == [threading.get_ident()]


def test_ctrl_c_taken_by_another_thread_still_stops_triforce_serve(tiny_model_dir):
    """POSIX may hand a process's signal to any of its threads (on an H200 a served request's
    Ctrl-C never stopped serve); Python runs the handler only on the main thread, which then sat in
    an unbounded wait for the next request."""
    listener = socket.create_server(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    main, stopped, answers = threading.get_ident(), threading.Event(), []

    def client() -> None:
        try:
            wait_for(lambda: _healthy(url), "the server to listen")
            answers.append(_complete(url))
            http = next(t for t in threading.enumerate() if t.name == "triforce-http")
            signal.pthread_kill(http.ident, signal.SIGINT)  # the C handler runs there, Python's on main
            answers.append(stopped.wait(30))
        finally:
            if not stopped.is_set():  # the main thread's wait ends only when a signal lands on it
                signal.pthread_kill(main, signal.SIGTERM)

    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    thread = threading.Thread(target=client)
    thread.start()
    try:
        assembly.run_server(_config(tiny_model_dir("llama-gqa")), listener, None, None, 2, 4, quiet=True)
        stopped.set()
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
        thread.join()
    assert len(answers) == 2 and answers[1] is True


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=5).status_code == 200
    except httpx.TransportError:
        return False


def test_a_benchmarks_rows_decode_on_the_calling_thread(tiny_model_dir, monkeypatch):
    seen = _spy_on_rows(monkeypatch)
    api, _ = build_api(_config(tiny_model_dir("llama-gqa")), batch_size=2, quiet=True)
    answers = serve_while(api, lambda url: [_complete(url), _complete(url)])
    assert len(answers) == 2 and answers[0] == answers[1]
    assert seen == [threading.get_ident()] * 2


def test_a_benchmarks_failure_is_raised_after_the_server_stops(tiny_model_dir):
    api, _ = build_api(_config(tiny_model_dir("llama-gqa")), batch_size=1, quiet=True)

    def broken(url: str):
        raise ValueError("the client broke")

    with pytest.raises(ValueError, match="the client broke"):
        serve_while(api, broken)
    with pytest.raises(RuntimeError, match="shutting down"):  # the decoding ended with the server
        api.scheduler.submit(None)
