"""The values of triforce's Python API (triforce.app.llm): how to sample, what an answer is, and the
error for a bad argument. No torch here: `from triforce import SamplingParams` stays quick."""
from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Sequence

from triforce.config import SamplingParams as _Sampling
from triforce.errors import UserError

_FINISH = {"eos": "stop", "stop": "stop", "length": "length", "context": "length", "interrupt": "interrupted"}
MAX_LOGPROBS = 20  # alternatives per token, OpenAI's bound (triforce.decoding.logprobs.MAX_TOP)
MAX_CHOICES = 128


class BadValue(UserError, ValueError):
    """An argument out of range: a UserError the CLI would print as one line, and a ValueError."""


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens. temperature 0 is greedy; top_k 0 and top_p 1 turn those filters off;
    repeat_penalty (llama.cpp's), presence_penalty and frequency_penalty (OpenAI's) act on the
    tokens among the context's last penalty_last_n, exactly in every method (1.0, 0 and 0: off);
    max_tokens new tokens at most; stop: strings that end the answer (not included in .text);
    n answers per prompt (each its own sample; a seeded request's answer i is seeded from the seed
    and i, answer 0 with the seed itself); logprobs: each emitted token's log-probability and
    that many most likely alternatives (0 to 20; None: none), under the model before penalties,
    temperature and filters, as vLLM and OpenAI report them."""
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int = 128
    stop: Sequence[str] = ()
    ignore_eos: bool = False
    repeat_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    penalty_last_n: int = 64
    n: int = 1
    logprobs: int | None = None

    def __post_init__(self):
        try:
            self.engine_params()
        except UserError as e:
            raise BadValue(str(e)) from None
        if not isinstance(self.max_tokens, int) or self.max_tokens < 0:
            raise BadValue(f"max_tokens must be an integer >= 0, got {self.max_tokens!r}")
        if isinstance(self.n, bool) or not isinstance(self.n, int) or not 1 <= self.n <= MAX_CHOICES:
            raise BadValue(f"n must be an integer from 1 to {MAX_CHOICES}, got {self.n!r}")
        if self.logprobs is not None and (isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise BadValue(f"logprobs must be None or an integer from 0 to {MAX_LOGPROBS}, got {self.logprobs!r}")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if not all(isinstance(s, str) for s in stop):
            raise BadValue(f"stop must be a string or a list of strings, got {self.stop!r}")
        object.__setattr__(self, "stop", stop)

    def engine_params(self) -> _Sampling:
        return _Sampling(**{f.name: getattr(self, f.name) for f in fields(_Sampling)})

    @classmethod
    def of(cls, sampling: _Sampling, **rest) -> "SamplingParams":
        """These parameters from the engine's, with max_tokens, stop and ignore_eos given here."""
        return cls(**{f.name: getattr(sampling, f.name) for f in fields(_Sampling)}, **rest)


@dataclass
class CompletionOutput:
    """One of a prompt's n answers (vLLM's name and fields). logprobs: per emitted token, a dict
    of token id -> log-probability holding the token and the `logprobs` most likely alternatives
    (None unless asked for); cumulative_logprob: the sum over the emitted tokens (None likewise)."""
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float | None = None


@dataclass
class Result:
    """One prompt's answer. finish_reason: "stop" (end of sequence or a stop string), "length"
    (max_tokens or the context), "interrupted". stats: what `generate --json` reports (method and
    why, tokens per second, acceptance per tier, the memory plan, ...). outputs: every answer
    when SamplingParams(n=...) asks for several (vLLM's RequestOutput.outputs); text, token_ids
    and finish_reason are the first one's. prompt_token_ids: the prompt as the model saw it."""
    text: str
    token_ids: list[int]
    finish_reason: str
    stats: dict = field(default_factory=dict, repr=False)
    outputs: list[CompletionOutput] = field(default_factory=list, repr=False)
    prompt_token_ids: list[int] = field(default_factory=list, repr=False)

    def __post_init__(self):
        if not self.outputs:
            self.outputs = [CompletionOutput(0, self.text, self.token_ids, self.finish_reason)]

    @staticmethod
    def finish_reason_of(stopped_by: str) -> str:
        """The engine's stopped_by ("eos", "length", "context", "interrupt") or "stop" (a stop string)."""
        return _FINISH.get(stopped_by, stopped_by)


def sampling_of(params: SamplingParams | None, sampling_params: SamplingParams | None, keywords: dict,
                defaults: SamplingParams) -> SamplingParams:
    """The parameters of a call: `params` or vLLM's `sampling_params=` (not both), else the
    model's `defaults`; any of SamplingParams' fields given as keywords replace theirs
    (`max_tokens=64`)."""
    if params is not None and sampling_params is not None:
        raise BadValue("give the sampling parameters once: params or sampling_params=")
    params = params if params is not None else sampling_params
    if params is not None and not isinstance(params, SamplingParams):
        raise BadValue(f"sampling parameters must be a triforce.SamplingParams, got {type(params).__name__}")
    names = [f.name for f in fields(SamplingParams)]
    unknown = sorted(set(keywords) - set(names))
    if unknown:
        raise BadValue(f"unknown keyword '{unknown[0]}': the sampling keywords are {', '.join(names)}")
    return replace(params or defaults, **keywords)


def check_messages(messages) -> None:
    roles = ("system", "user", "assistant")
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and m.get("role") in roles and isinstance(m.get("content"), str) for m in messages):
        raise BadValue(f"messages must be a non-empty list of {{'role': one of {roles}, 'content': str}}")

