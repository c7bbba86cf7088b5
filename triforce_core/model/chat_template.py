"""Render a conversation with the model's chat template, bounded in time and size.

A chat template is code that came with the model: transformers runs it in Jinja's sandbox, so
it cannot reach Python objects (SecurityError), but it can still fail, loop for a very long
time, or write gigabytes. Any of these is one error line here, never a traceback or a hang."""
from __future__ import annotations

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
