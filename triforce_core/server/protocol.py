"""OpenAI's request bodies (the parameters triforce honours, checked; those it cannot honour
refused by name rather than ignored) and its error shape."""
from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from triforce.config import SEED_MAX, SEED_MIN

MAX_STOPS = 4  # as OpenAI


class ApiError(Exception):
    """An answer in OpenAI's error shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    include_usage: bool = False


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class Message(BaseModel):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def as_template_message(self) -> dict:
        """{"role", "content"} as the chat template takes it ('developer' is OpenAI's new name
        for the system role; content parts joined as one text)."""
        content = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": content}


MAX_CHOICES = 8  # n: each choice is a row, so a request takes at most this many of the server's rows
MAX_TOP = 20     # top_logprobs, OpenAI's bound


class _Common(BaseModel):
    """Parameters of both endpoints. Unknown fields are ignored, as OpenAI's own server does."""
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)  # top_k and ignore_eos: not OpenAI's, but vLLM's and others'
    ignore_eos: bool | None = False
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = 1
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repeat_penalty: float | None = Field(None, gt=0, le=10)  # llama.cpp server's names, for its clients
    repeat_last_n: int | None = Field(None, ge=1, le=1 << 20)
    logit_bias: dict | None = None
    logprobs: bool | int | None = None
    user: str | None = None

    def refuse_unsupported(self) -> None:
        """What would change the answer in a way triforce cannot do: 400, the parameter named."""
        if self.n is not None and not 1 <= self.n <= MAX_CHOICES:
            raise ApiError(400, f"n must be between 1 and {MAX_CHOICES} (choices decode as rows of one batch), "
                                f"got {self.n}", "n")
        if self.logit_bias:
            raise ApiError(400, "logit_bias is not supported", "logit_bias")
        if self.stream_options is not None and not self.stream:
            raise ApiError(400, "stream_options needs stream: true", "stream_options")
        stops = self.stop_strings()
        if len(stops) > MAX_STOPS:
            raise ApiError(400, f"stop takes at most {MAX_STOPS} strings, got {len(stops)}", "stop")
        if self.temperature is not None and not math.isfinite(self.temperature):
            raise ApiError(400, "temperature must be a finite number", "temperature")

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class ChatRequest(_Common):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    top_logprobs: int | None = None
    tools: list | None = None
    tool_choice: str | dict | None = None
    functions: list | None = None
    response_format: dict | None = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        for name in ("tools", "functions"):
            if getattr(self, name):
                raise ApiError(400, f"{name} (tool calling) is not supported", name)
        if self.tool_choice not in (None, "none", "auto"):
            raise ApiError(400, "tool_choice is not supported", "tool_choice")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_TOP:
            raise ApiError(400, f"top_logprobs must be between 0 and {MAX_TOP}, got {self.top_logprobs}", "top_logprobs")
        if self.top_logprobs and not self.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        if self.response_format not in (None, {"type": "text"}):
            raise ApiError(400, "response_format other than text is not supported", "response_format")

    def wanted_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def logprobs_top(self) -> int | None:
        """None: no logprobs asked; else how many alternatives each token lists."""
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int]
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if isinstance(self.prompt, list) and not self.prompt:
            raise ApiError(400, "prompt is empty", "prompt")
        if isinstance(self.prompt, list) and isinstance(self.prompt[0], str) and len(self.prompt) != 1:
            raise ApiError(400, "prompt must be one string (a batch of prompts is several requests here)", "prompt")
        if self.echo:
            raise ApiError(400, "echo is not supported", "echo")
        if self.suffix:
            raise ApiError(400, "suffix is not supported", "suffix")
        if self.best_of not in (None, 1):
            raise ApiError(400, "best_of must be 1", "best_of")
        if self.logprobs is not None and not isinstance(self.logprobs, bool) and not 0 <= self.logprobs <= 5:
            raise ApiError(400, f"logprobs must be between 0 and 5 for completions, got {self.logprobs}", "logprobs")

    def wanted_tokens(self) -> int | None:
        return 16 if self.max_tokens is None else self.max_tokens  # OpenAI's default for completions

    def logprobs_top(self) -> int | None:
        """None: no logprobs asked; else how many alternatives each token lists (OpenAI's legacy
        field is that count)."""
        return None if self.logprobs is None or self.logprobs is False else int(self.logprobs)


_FIELDS = {"role", "content", "text", "type", "name", "include_usage"}


def parse(model: type[_Common], data) -> _Common:
    """The request body as `model`, or ApiError 400 naming the first bad parameter."""
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        request = model.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        param = _param_name(first["loc"])
        raise ApiError(400, f"{param}: {first['msg']}", param) from None
    request.refuse_unsupported()
    return request


def _param_name(loc: tuple) -> str:
    """('messages', 0, 'content', 'str') -> 'messages[0].content' (union members' tags dropped)."""
    name = str(loc[0]) if loc else "body"
    for part in loc[1:]:
        if isinstance(part, int):
            name += f"[{part}]"
        elif part in _FIELDS:
            name += f".{part}"
        else:
            break
    return name
