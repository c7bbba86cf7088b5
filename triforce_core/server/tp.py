"""`triforce serve --tp N`: rank 0 serves HTTP and decodes one request at a time; before each,
it announces the request (token ids, length, sampling) to the other ranks, which decode it beside
rank 0 with their shares of the heads (the engine's own collectives keep them in step: every
rank reaches the same logits, rank 0's decisions are broadcast). None announced: the server is
stopping. A request whose client left before it started is never announced."""
from __future__ import annotations

import signal

from triforce.app.batch_generate import row_models
from triforce.app.rank_idle import Announcer, receive


def lead_requests(scheduler) -> None:
    """Rank 0's decoding thread (triforce.server.scheduler.Scheduler with runtime.world > 1); while
    it waits for a request, heartbeats keep the other ranks' collective from timing out."""
    announcer = Announcer()
    while True:
        with announcer.idle():
            job = scheduler.next_job(True)
        if job is None:
            break
        if not job.stop:
            announcer.announce((job.ids, job.max_new, job.params, job.ignore_eos))
        scheduler.serve_request(job)  # a stopped job ends before any collective
    announcer.stop()
    announcer.announce(None)  # not after a failure: the other ranks may be inside a pass (tp.launch stops them)


def follow_requests(runtime, run, max_len: int) -> None:
    """A rank other than 0: build the same engine as rank 0's, then decode what it announces."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0 decides when to stop
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    lm, draft = row_models(runtime)  # never attached to a lane: one request at a time
    engine = None
    while (request := receive()) is not None:
        ids, max_new, params, ignore_eos = request
        if engine is None:  # built where rank 0 builds its own: at the first request
            engine = runtime.engine(max_len, run, lm=lm, draft=draft, graphs="off")
        engine.set_sequence(ids)
        engine.generate(max_new, params, frozenset() if ignore_eos else runtime.lm.eos_ids,
                        stop_requested=lambda: bool(engine.hooks.agree([0])[0]))
