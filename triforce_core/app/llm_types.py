"""The values of triforce's Python API (triforce.app.llm): how to sample, what an answer is, and the
error for a bad argument. No torch here: `from triforce import SamplingParams` stays quick."""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Sequence

from triforce.config import SamplingParams as _Sampling
from triforce.errors import UserError

_FINISH = {"eos": "stop", "stop": "stop", "length": "length", "context": "length", "interrupt": "interrupted"}


class BadValue(UserError, ValueError):
    """An argument out of range: a UserError the CLI would print as one line, and a ValueError."""


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens. temperature 0 is greedy; top_k 0 and top_p 1 turn those filters off;
    repeat_penalty (llama.cpp's), presence_penalty and frequency_penalty (OpenAI's) act on the
    tokens among the context's last penalty_last_n, exactly in every method (1.0, 0 and 0: off);
    max_tokens new tokens at most; stop: strings that end the answer (not included in .text)."""
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

    def __post_init__(self):
        try:
            self.engine_params()
        except UserError as e:
            raise BadValue(str(e)) from None
        if not isinstance(self.max_tokens, int) or self.max_tokens < 0:
            raise BadValue(f"max_tokens must be an integer >= 0, got {self.max_tokens!r}")
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
class Result:
    """One prompt's answer. finish_reason: "stop" (end of sequence or a stop string), "length"
    (max_tokens or the context), "interrupted". stats: what `generate --json` reports (method and
    why, tokens per second, acceptance per tier, the memory plan, ...)."""
    text: str
    token_ids: list[int]
    finish_reason: str
    stats: dict = field(default_factory=dict, repr=False)

    @staticmethod
    def finish_reason_of(stopped_by: str) -> str:
        """The engine's stopped_by ("eos", "length", "context", "interrupt") or "stop" (a stop string)."""
        return _FINISH.get(stopped_by, stopped_by)


def check_messages(messages) -> None:
    roles = ("system", "user", "assistant")
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and m.get("role") in roles and isinstance(m.get("content"), str) for m in messages):
        raise BadValue(f"messages must be a non-empty list of {{'role': one of {roles}, 'content': str}}")

