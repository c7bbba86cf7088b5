"""The other ways triforce.LLM decodes: many prompts as one batch (`generate --prompts`'s path),
text pieces streamed as decoding makes them, and a conversation whose KV stays
between turns (`triforce chat`'s Chat)."""
from __future__ import annotations

import threading
from typing import Iterator

from triforce.app.llm_types import BadValue, Result, SamplingParams, check_messages


def generate_batch(llm, prompts: list[list[int]], params: SamplingParams) -> list[Result]:
    """Every prompt decoded with the batch size the memory plan fits (at most 32 rows at once);
    each row's tokens are those of its own run. Stop strings cut the text after decoding."""
    from triforce.app.batch_generate import fit_batch, row_json
    from triforce.app.batch_generate import generate_batch as decode_batch
    from triforce.app.completion import room_for

    runtime = llm.runtime
    news = [room_for(ids, llm.context, params.max_tokens) for ids in prompts]
    max_len = max(len(ids) + max(n, 1) for ids, n in zip(prompts, news))
    rows, run = fit_batch(runtime, max_len, len(prompts), None)
    stop_ids = frozenset() if params.ignore_eos else runtime.lm.eos_ids
    outcome = decode_batch(runtime, prompts, news, params.engine_params(), stop_ids, rows, run)
    results = []
    for row, new, ids in zip(outcome.rows, news, prompts):
        stats = {**row_json(llm.tokenizer, row, run.spec.method), "batch_size": rows, "max_tokens": new,
                 "plan": run.plan.to_json()}  # generate --prompts --json's fields for this prompt
        text, stopped = stats.pop("text"), stats["stopped_by"]
        cuts = [i for i in (text.find(s) for s in params.stop if s) if i >= 0]
        if cuts:
            text, stopped = text[:min(cuts)], "stop"
        stats["stopped_by"] = stopped
        results.append(Result(text, stats.pop("tokens"), Result.finish_reason_of(stopped), stats,
                              prompt_token_ids=list(ids)))
    return results


def stream_pieces(llm, ids: list[int], params: SamplingParams) -> Iterator[str]:
    """Checks the prompt now, then decodes piece by piece as the caller takes them."""
    from triforce.app.completion import room_for

    room_for(ids, llm.context, params.max_tokens)  # a prompt that cannot fit fails here, not at the first next()
    return _pieces(llm, ids, params)


_END = object()


def _pieces(llm, ids: list[int], params: SamplingParams) -> Iterator[str]:
    """Decoding runs in a greenlet on the caller's thread, which it leaves at each piece: on a
    thread of its own it ran at half the speed (OpenMP throttles the spin of workers that any thread
    but the process's first starts, triforce.server.scheduler.Scheduler.serve_here)."""
    from greenlet import getcurrent, greenlet

    stop = threading.Event()

    def work() -> object:
        llm.complete_ids(ids, params, on_text=lambda piece: worker.parent.switch(piece), stop_flag=stop)
        return _END

    worker = greenlet(work)
    try:
        while True:
            worker.parent = getcurrent()  # its pieces, its end and its errors come back here
            item = worker.switch()
            if item is _END:
                return
            yield item
    finally:  # the caller stopped early: decoding stops at its next round, its pieces dropped
        stop.set()
        while not worker.dead:
            worker.parent = getcurrent()
            worker.switch()


class Conversation:
    """Turns of one chat over one engine of the whole context: each turn prefills only what is new
    since the last (triforce.app.chat.Chat, as `triforce chat`)."""

    def __init__(self, llm, system: str | None = None):
        from triforce.app.chat import Chat

        if system is not None and not isinstance(system, str):
            raise BadValue(f"system must be a string, got {system!r}")
        runtime = llm.runtime
        max_len = llm.context
        self._llm = llm
        self._chat = Chat(runtime.lm, max_len, system=system, engine=runtime.engine(max_len, runtime.plan(max_len)))

    @property
    def messages(self) -> list[dict]:
        """The conversation so far ({"role", "content"} each, the answers included)."""
        return [dict(m) for m in self._chat.messages]

    def send(self, text: str, params: SamplingParams | None = None) -> Result:
        """The answer to `text` as the next user message (stop strings are not applied here)."""
        from triforce.app.completion import room_for

        params = params or self._llm.default_sampling_params()
        check_messages([{"role": "user", "content": text}])
        new = room_for([0], self._llm.context, params.max_tokens)  # bounded again by the chat's own check
        result = self._chat.ask(text, params.engine_params(), new)
        stats = {**self._chat.stats(), **result.stats, "prefilled_tokens": self._chat.last_prefill_tokens,
                 "stopped_by": result.stopped_by}
        answer = self._chat.messages[-1]["content"]
        return Result(answer, list(result.tokens), Result.finish_reason_of(result.stopped_by), stats)

    def reset(self) -> None:
        """Forget every turn (the system message stays)."""
        self._chat.reset()

    def stats(self) -> dict:
        """What `/stats` shows in `triforce chat`."""
        return self._chat.stats()
