"""The OpenAI-compatible HTTP API (Starlette): /v1/chat/completions, /v1/completions (streamed
as server-sent events or not), /v1/models and /health. Requests are checked, rendered and
tokenized here, on the event loop; their rows decode on the scheduler's thread."""
from __future__ import annotations

import asyncio
import hmac
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import AsyncIterator

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, StreamingResponse
from starlette.routing import Route

from triforce.app.chat import render_messages
from triforce.app.inputs import text_bound
from triforce.app.textstream import TextStream
from triforce.decoding.sampling import choice_seed
from triforce.errors import UserError
from triforce.model.sampling_defaults import model_sampling, with_given
from triforce.server.guard import HostGuard, read_json_body
from triforce.server.protocol import ApiError, ChatRequest, CompletionRequest, parse
from triforce.server.replies import Reply
from triforce.server.scheduler import Job, QueueFull, Scheduler
from triforce.app.stop_text import StopText

FINISH = {"eos": "stop", "length": "length", "context": "length"}


class Api:
    def __init__(self, lm, scheduler: Scheduler, model_id: str, context: int, api_key: str | None = None,
                 origins: tuple[str, ...] = (), parse_special: bool = False, hosts: frozenset[str] | None = None):
        """origins: web pages (scheme://host:port, or *) whose scripts may call the API (CORS).
        parse_special: read control tokens inside messages (default: their text is text).
        hosts: the Host names answered (triforce.server.guard; None: any)."""
        self.hosts = hosts
        self.lm, self.scheduler, self.model_id = lm, scheduler, model_id
        self.parse_special = parse_special
        self.context, self.api_key, self.origins = context, api_key, tuple(origins)
        self.created = int(time.time())
        self.requests = 0

    def app(self) -> Starlette:
        @asynccontextmanager
        async def lifespan(app):
            self.scheduler.start()
            yield
            await asyncio.get_running_loop().run_in_executor(None, self.scheduler.close)

        routes = [Route("/", self.page), Route("/health", self.health), Route("/v1/models", self.models),
                  Route("/v1/chat/completions", self.chat, methods=["POST"]),
                  Route("/v1/completions", self.completions, methods=["POST"])]
        handlers = {ApiError: _api_error, HTTPException: _http_error}
        middleware = []
        if self.hosts is not None:
            from starlette.middleware import Middleware
            middleware.append(Middleware(HostGuard, hosts=self.hosts))
        if self.origins:
            from starlette.middleware import Middleware
            from starlette.middleware.cors import CORSMiddleware
            middleware.append(Middleware(CORSMiddleware, allow_origins=list(self.origins), allow_methods=["*"],
                                         allow_headers=["*"]))
        return Starlette(routes=routes, exception_handlers=handlers, lifespan=lifespan, middleware=middleware)

    # ---- endpoints ---------------------------------------------------------------------------
    async def page(self, request: Request) -> HTMLResponse:
        """The chat page (self-contained: no other files, nothing fetched from elsewhere); its
        requests go through the API, key included, like any client's."""
        from importlib import resources
        return HTMLResponse(resources.files("triforce.server").joinpath("chat_page.html").read_text(encoding="utf-8"))

    async def health(self, request: Request) -> JSONResponse:
        failure = self.scheduler.failure
        defaults = model_sampling(self.lm).params  # what a request's absent fields take (the chat page shows it)
        body = {"status": "error" if failure else "ok", "model": self.model_id, "method": self.scheduler.run.spec.method,
                "sampling": {"temperature": defaults.temperature, "top_p": defaults.top_p, "top_k": defaults.top_k,
                             "repeat_penalty": defaults.repeat_penalty}, **self.scheduler.status()}
        if failure:
            body["error"] = failure
        return JSONResponse(body, status_code=503 if failure else 200)

    async def models(self, request: Request) -> JSONResponse:
        self._check_key(request)
        return JSONResponse({"object": "list", "data": [
            {"id": self.model_id, "object": "model", "created": self.created, "owned_by": "triforce",
             "max_context": self.context}]})

    async def chat(self, request: Request):
        self._check_key(request)
        body = parse(ChatRequest, await read_json_body(request))
        messages = [m.as_template_message() for m in body.messages]
        try:
            ids = render_messages(self.lm.tokenizer, messages, True, self.context, self.parse_special)
        except UserError as e:  # a template failure, or far more text than the context holds
            raise ApiError(400, str(e), "messages", code="context_length_exceeded"
                           if "context" in str(e) else None) from None
        return await self._answer(request, body, ids, "messages", chat=True)

    async def completions(self, request: Request):
        self._check_key(request)
        body = parse(CompletionRequest, await read_json_body(request))
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
            vocab = self.lm.config.vocab_size
            if not all(0 <= t < vocab for t in prompt):
                raise ApiError(400, f"prompt token ids must be in [0, {vocab})", "prompt")
            ids = list(prompt)
        else:
            text = prompt[0] if isinstance(prompt, list) else prompt
            if len(text) > text_bound(self.context):  # refused before the tokenizer spends time on it
                raise ApiError(400, f"the prompt is far longer than the {self.context}-token context", "prompt",
                               code="context_length_exceeded")
            ids = self.lm.tokenizer(text).input_ids  # as `triforce generate`: special tokens included
        return await self._answer(request, body, ids, "prompt", chat=False)

    # ---- one answer ----------------------------------------------------------------------------
    def _check_key(self, request: Request) -> None:
        if self.api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
            raise ApiError(401, "Incorrect or missing API key (send 'Authorization: Bearer KEY')",
                           code="invalid_api_key")

    async def _answer(self, request: Request, body, ids: list[int], what: str, chat: bool):
        if not ids:
            raise ApiError(400, f"the {what} is empty after tokenisation", what)
        room = self.context - len(ids)
        if room <= 0:
            raise ApiError(400, f"the {what} has {len(ids)} tokens but the context holds {self.context}", what,
                           code="context_length_exceeded")
        wanted = body.wanted_tokens()
        # the fields a request leaves out: the model's defaults (triforce.model.sampling_defaults)
        params = with_given(model_sampling(self.lm).params, temperature=body.temperature, top_p=body.top_p,
                            top_k=body.top_k, seed=body.seed, presence_penalty=body.presence_penalty,
                            frequency_penalty=body.frequency_penalty, repeat_penalty=body.repeat_penalty,
                            penalty_last_n=body.repeat_last_n)
        self.requests += 1
        kind = "chatcmpl" if chat else "cmpl"
        label = f"#{self.requests} {'chat' if chat else 'completion'}"
        choices = []
        try:
            for index in range(body.n or 1):  # n choices: rows of their own, each with a seed of its own
                seeded = replace(params, seed=None if params.seed is None else choice_seed(params.seed, index))
                job = Job(ids, min(room, wanted or room), seeded, None, label, ignore_eos=bool(body.ignore_eos),
                          logprobs=body.logprobs_top())
                choices.append(self._decode(job, body.stop_strings()))
                await anext(choices[-1])  # ('queued',): QueueFull and a failed thread answer before any byte
        except BaseException:
            for pieces in choices:
                await pieces.aclose()  # the rows already queued stop
            raise
        reply = Reply(f"{kind}-{uuid.uuid4().hex}", int(time.time()), self.model_id, chat,
                      logprobs=body.logprobs_top() is not None)
        if body.stream:
            usage = body.stream_options is not None and body.stream_options.include_usage
            return StreamingResponse(reply.stream(choices, usage), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return JSONResponse(await reply.whole(request, choices))

    def _logprob(self, entry) -> dict:
        """A decoding.logprobs.TokenLogprob in OpenAI's chat form (each token as its own text)."""
        def one(token: int, logprob: float) -> dict:
            text = self.lm.tokenizer.decode([token])
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}
        return {**one(entry.token, entry.logprob), "top_logprobs": [one(t, lp) for t, lp in entry.top]}

    async def _decode(self, job: Job, stops: list[str]) -> AsyncIterator[tuple]:
        """("queued",) first, then ("text", str, logprobs) and ("progress", done, total) as they come,
        then ("end", finish_reason, usage); logprobs: the entries (OpenAI's chat form) of the tokens
        behind the text, where the job asked for them. Closing it early (the client left) stops the row."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def emit(event: tuple) -> None:  # on the decoding thread
            try:
                loop.call_soon_threadsafe(events.put_nowait, event)
            except RuntimeError:  # the loop has closed: nobody is listening
                pass

        job.emit, ids = emit, job.ids
        try:
            self.scheduler.submit(job)
        except QueueFull:
            raise ApiError(503, "the server is busy: every row is decoding and the queue is full; retry later",
                           kind="server_error", code="queue_full") from None
        except RuntimeError as e:
            raise ApiError(503, str(e), kind="server_error") from None
        try:
            yield ("queued",)
            stream, stop = TextStream(self.lm.tokenizer), StopText(stops)
            reused, tokens, done, behind = 0, 0, 0, []
            while True:
                event = await events.get()
                if event[0] == "token":
                    tokens += 1
                    if event[2] is not None:
                        behind.append(self._logprob(event[2]))
                    text = stop.feed(stream.push(event[1]))
                    if text:
                        yield ("text", text, behind)
                        behind = []
                    if stop.matched:
                        job.stop = True
                        finish = "stop"
                        break
                elif event[0] == "prefill":
                    reused = event[1]
                elif event[0] == "progress":
                    done += event[1]
                    yield ("progress", reused + done, len(ids) - 1)
                elif event[0] == "done":
                    rest = stop.flush()
                    if rest or behind:
                        yield ("text", rest, behind)
                    finish = FINISH.get(event[1], "stop")
                    break
                else:
                    raise ApiError(500, event[1], kind="server_error")
            yield ("end", finish, {"prompt_tokens": len(ids), "completion_tokens": tokens,
                                   "total_tokens": len(ids) + tokens,
                                   "prompt_tokens_details": {"cached_tokens": reused}})
        finally:
            job.stop = True  # the client went away (or the answer is complete): free the row


async def _api_error(request: Request, e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


async def _http_error(request: Request, e: HTTPException) -> JSONResponse:
    return JSONResponse(ApiError(e.status_code, e.detail, kind="invalid_request_error").body(),
                        status_code=e.status_code, headers=getattr(e, "headers", None))
