"""The response objects of one request, whole or as server-sent chunks, for its `n` choices.

Each choice is a row of its own (its pieces: ("text", str, logprobs), ("progress", done, total),
then ("end", finish, usage)); the rows decode together and their pieces are merged as they come,
each chunk naming its choice's index. Usage counts the prompt once and every choice's tokens.
Logprobs, where asked, go with the text of their tokens: OpenAI's chat form ({"content": [...]})
or, for completions, its legacy one (tokens, token_logprobs, top_logprobs, text_offset)."""
from __future__ import annotations

import asyncio
import json
from typing import AsyncIterator

from starlette.requests import Request

from triforce.server.protocol import ApiError


class Reply:
    def __init__(self, rid: str, created: int, model: str, chat: bool, logprobs: bool = False):
        self.head = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
                     "model": model}
        self.chat, self.logprobs = chat, logprobs
        self._offsets: dict[int, int] = {}  # completions' text_offset: characters so far, per choice

    def _choice(self, index: int, text: str | None, finish: str | None, delta: bool, entries=()) -> dict:
        if not self.chat:
            return {"index": index, "text": text or "", "logprobs": self._legacy(index, entries),
                    "finish_reason": finish}
        content = {"content": text} if text is not None else {}
        key = "delta" if delta else "message"
        return {"index": index, key: content if delta else {"role": "assistant", **content},
                "logprobs": {"content": list(entries)} if self.logprobs else None, "finish_reason": finish}

    def _legacy(self, index: int, entries) -> dict | None:
        if not self.logprobs:
            return None
        offsets = []
        for entry in entries:
            offsets.append(self._offsets.get(index, 0))
            self._offsets[index] = offsets[-1] + len(entry["token"])
        return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
                "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
                "text_offset": offsets}

    async def whole(self, request: Request, choices: list) -> dict:
        """Every piece gathered; the rows stop if the client disconnects meanwhile."""
        gone = asyncio.ensure_future(_disconnected(request))
        merged = _merged(choices)
        parts: list[list[str]] = [[] for _ in choices]
        entries: list[list[dict]] = [[] for _ in choices]
        ends: dict[int, tuple] = {}
        try:
            while len(ends) < len(choices):
                step = asyncio.ensure_future(anext(merged))
                await asyncio.wait({step, gone}, return_when=asyncio.FIRST_COMPLETED)
                if not step.done():
                    step.cancel()
                    raise ApiError(499, "the client closed the connection")
                index, piece = step.result()
                if piece[0] == "text":
                    parts[index].append(piece[1])
                    entries[index] += piece[2]
                elif piece[0] == "end":
                    ends[index] = piece
            return {**self.head, "choices": [self._choice(i, "".join(parts[i]), ends[i][1], False, entries[i])
                                             for i in range(len(choices))],
                    "usage": _usage([ends[i][2] for i in range(len(choices))])}
        finally:
            gone.cancel()
            await merged.aclose()

    async def stream(self, choices: list, include_usage: bool) -> AsyncIterator[str]:
        head = {**self.head, "object": "chat.completion.chunk" if self.chat else "text_completion"}
        extra = {"usage": None} if include_usage else {}
        merged = _merged(choices)
        usages: list[dict] = []
        try:
            if self.chat:
                for index in range(len(choices)):
                    opening = {**head, "choices": [{"index": index, "delta": {"role": "assistant", "content": ""},
                                                    "logprobs": None, "finish_reason": None}], **extra}
                    yield _event(opening)
            async for index, piece in merged:
                if piece[0] == "text":
                    yield _event({**head, "choices": [self._choice(index, piece[1], None, True, piece[2])], **extra})
                elif piece[0] == "progress" and index == 0:
                    yield f": prefill {piece[1]}/{piece[2]}\n\n"  # a comment: clients skip it
                elif piece[0] == "end":
                    closing = self._choice(index, None if self.chat else "", piece[1], True)
                    yield _event({**head, "choices": [closing], **extra})
                    usages.append(piece[2])
            if include_usage:
                yield _event({**head, "choices": [], "usage": _usage(usages)})
        except ApiError as e:  # a row failed after the stream began: say so in the stream
            yield _event(e.body())
        finally:
            await merged.aclose()
        yield "data: [DONE]\n\n"


def _usage(usages: list[dict]) -> dict:
    """The prompt once (the choices share it), every choice's tokens."""
    first = usages[0]
    completion = sum(u["completion_tokens"] for u in usages)
    return {**first, "completion_tokens": completion, "total_tokens": first["prompt_tokens"] + completion}


async def _merged(choices: list) -> AsyncIterator[tuple[int, tuple]]:
    """(index, piece) from every choice's pieces as they come, until each has ended; closing it
    closes them all (their rows stop)."""
    if len(choices) == 1:  # the common case: no tasks in between
        try:
            async for piece in choices[0]:
                yield 0, piece
        finally:
            await choices[0].aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, pieces) -> None:
        try:
            async for piece in pieces:
                await queue.put((index, piece))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # an ApiError from a row ends the merge with it
            await queue.put((index, e))
        finally:
            queue.put_nowait((index, None))

    tasks = [asyncio.ensure_future(pump(i, pieces)) for i, pieces in enumerate(choices)]
    try:
        running = len(choices)
        while running:
            index, piece = await queue.get()
            if piece is None:
                running -= 1
            elif isinstance(piece, BaseException):
                raise piece
            else:
                yield index, piece
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)  # each row's generator closed (its row stops)
        for pieces in choices:
            await pieces.aclose()


def _event(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
