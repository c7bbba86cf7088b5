"""Render a conversation with the model's chat template, bounded in time and size.

A chat template is code that came with the model: transformers runs it in Jinja's sandbox, so
it cannot reach Python objects (SecurityError), but it can still fail, loop for a very long
time, or write gigabytes. Any of these is one error line here, never a traceback or a hang."""
from __future__ import annotations

import re
import signal
import threading
from contextlib import contextmanager

from triforce.errors import UserError

RENDER_SECONDS = 5.0  # real templates render in milliseconds


class _TooSlow(Exception):
    pass


@contextmanager
def _time_limit(seconds: float):
    """SIGALRM interrupts the Python code a template compiles to. Signals reach only the main
    thread, so elsewhere the render runs unbounded in time (still bounded in size)."""
    usable = threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer")
    if not usable or signal.getitimer(signal.ITIMER_REAL)[0] > 0:  # never steal a timer in use
        yield
        return

    def expire(signum, frame):
        raise _TooSlow

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def render_chat(tokenizer, messages: list[dict], add_generation_prompt: bool, max_chars: int) -> str:
    """The template's text for `messages`; max_chars: what could still fit the context."""
    try:
        with _time_limit(RENDER_SECONDS):
            text = tokenizer.apply_chat_template(messages, tokenize=False,
                                                 add_generation_prompt=add_generation_prompt)
    except _TooSlow:
        raise UserError(f"the model's chat template did not finish rendering in {RENDER_SECONDS:g} s "
                        "(a runaway loop in tokenizer_config.json's chat_template?)") from None
    except Exception as e:  # the template is the model's code: any failure is the model's, not ours
        kind = type(e).__name__
        detail = str(e).strip().splitlines()[0] if str(e).strip() else kind
        raise UserError(f"the model's chat template failed ({kind}): {detail[:200]}") from None
    if not isinstance(text, str):
        raise UserError("the model's chat template did not render to text")
    if len(text) > max_chars:
        raise UserError(f"the chat template rendered {len(text):,} characters, far more than the context holds")
    return text


# marks a message's place while the template renders: private-use characters no text carries
_MARK = "\ue000{}\ue001"
_MARKS = re.compile("\ue000(\\d+)\ue001")


def control_texts(tokenizer) -> list[str]:
    """The strings the tokenizer reads as control tokens (its added tokens: <|im_end|>, [INST], ...)."""
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    return [t.content for t in added.values() if t.content] or list(getattr(tokenizer, "all_special_tokens", []))


def holds_control(tokenizer, messages: list[dict]) -> bool:
    """Whether some message's text holds a control token's string."""
    controls = control_texts(tokenizer)
    return any(c in str(m.get("content", "")) for m in messages for c in controls)


def chat_ids(tokenizer, messages: list[dict], add_generation_prompt: bool, max_chars: int,
             parse_special: bool = False) -> list[int]:
    """A conversation's token ids through the model's chat template. Text inside a message is
    tokenized as text: a user who writes "<|im_end|>" gets the characters, not the control token
    (role injection). The template's own markers stay control tokens. parse_special: read control
    tokens inside messages too (the old behaviour, for a user who means it)."""
    text = render_chat(tokenizer, messages, add_generation_prompt, max_chars)
    if parse_special or not holds_control(tokenizer, messages):
        return tokenizer(text, add_special_tokens=False).input_ids  # nothing to keep apart
    marked = [{**m, "content": _MARK.format(i)} for i, m in enumerate(messages)]
    template = _MARKS.split(render_chat(tokenizer, marked, add_generation_prompt, max_chars + 64 * len(messages)))
    pieces = [(template[i], i % 2 == 0) if i % 2 == 0 else (messages[int(template[i])]["content"], False)
              for i in range(len(template))]
    if "".join(p for p, _ in pieces) != text or sorted(map(int, template[1::2])) != list(range(len(messages))):
        raise UserError("a message holds a control token of the model (e.g. <|im_end|>) and its chat template "
                        "rewrites message text, so it cannot be kept as text: remove it, or pass "
                        "--parse-special-tokens to let messages hold control tokens")
    return pieces_ids(tokenizer, pieces)


def pieces_ids(tokenizer, pieces: list[tuple[str, bool]], parse_special: bool = False) -> list[int]:
    """Token ids of (text, is_template) pieces: the joined text at once (the tokenizer's own
    boundaries) where no message piece holds a control token's string or parse_special says
    to read them, else piece by piece (text_pieces_ids)."""
    controls = control_texts(tokenizer)
    if parse_special or not any(c in piece for piece, template in pieces if not template for c in controls):
        return tokenizer("".join(p for p, _ in pieces), add_special_tokens=False).input_ids
    return text_pieces_ids(tokenizer, pieces)


def text_pieces_ids(tokenizer, pieces: list[tuple[str, bool]]) -> list[int]:
    """Token ids of (text, is_template) pieces in order: template pieces may hold control tokens,
    the others are read as plain text."""
    ids: list[int] = []
    for piece, is_template in pieces:
        if piece:
            ids += tokenizer(piece, add_special_tokens=False, split_special_tokens=not is_template).input_ids
    return ids
