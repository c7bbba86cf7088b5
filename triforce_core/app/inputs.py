"""Reading a user's text files with a bound: a prompt or document can only be as long as the
context it must fit, so a huge file (or /dev/zero) is refused by its size, before it is read."""
from __future__ import annotations

import stat
import sys
from pathlib import Path

from triforce.errors import UserError

BYTES_PER_TOKEN = 64  # far above any tokenizer's average: text this long cannot fit the tokens left


def is_utf8(text: str) -> bool:
    """Python keeps bytes that are not UTF-8 (in arguments, on stdin) as lone surrogates,
    which every tokenizer rejects with a traceback."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def text_bound(tokens: int) -> int:
    """The most bytes a text of at most `tokens` tokens can reasonably take."""
    return max(tokens, 1) * BYTES_PER_TOKEN


def check_text_file(path: str | Path, what: str) -> Path:
    """A readable regular file, or one error line saying what it is instead."""
    p = Path(path).expanduser()
    try:
        mode = p.stat().st_mode
    except FileNotFoundError:
        raise UserError(f"{what} '{path}' does not exist") from None
    except OSError as e:
        raise UserError(f"cannot read {what} '{path}': {e.strerror}") from None
    if stat.S_ISDIR(mode):
        raise UserError(f"{what} '{path}' is a directory, not a file")
    if not stat.S_ISREG(mode):
        raise UserError(f"{what} '{path}' is not a regular file (a device, pipe or socket)")
    return p


def read_text_file(path: str | Path, what: str, max_bytes: int, room: str, errors: str = "strict") -> str:
    """The file's text, refused unread when it is longer than max_bytes (`room` says what bounds it)."""
    p = check_text_file(path, what)
    size = p.stat().st_size
    if size > max_bytes:
        raise UserError(f"{what} '{path}' is {size:,} bytes: too long for {room}")
    try:
        with open(p, "rb") as f:
            data = f.read(max_bytes + 1)  # the file may have grown since the check
    except OSError as e:
        raise UserError(f"cannot read {what} '{path}': {e.strerror}") from None
    if len(data) > max_bytes:
        raise UserError(f"{what} '{path}' grew past {max_bytes:,} bytes while being read: too long for {room}")
    try:
        return data.decode("utf-8", errors=errors)
    except UnicodeDecodeError as e:
        raise UserError(f"{what} '{path}' is not UTF-8 text ({e.reason} at byte {e.start})") from None


STDIN_PROMPT_BYTES = 64 << 20  # stdin has no size to check first: read at most this much


def read_prompt(prompt: str | None, prompt_file: str | None) -> str | None:
    """The prompt text now, for --prompt and stdin; None for a file, which is checked now and read
    after the model is known (app.inputs.read_text_file), so its size can be bounded by the context."""
    if (prompt is None) == (prompt_file is None):
        raise UserError("give exactly one of --prompt and --prompt-file")
    if prompt is not None:
        return prompt
    if prompt_file == "-":
        data = sys.stdin.buffer.read(STDIN_PROMPT_BYTES + 1)
        if len(data) > STDIN_PROMPT_BYTES:
            raise UserError(f"the prompt on stdin is longer than {STDIN_PROMPT_BYTES:,} bytes")
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise UserError(f"the prompt on stdin is not UTF-8 text ({e.reason} at byte {e.start})") from None
    check_text_file(prompt_file, "prompt file")
    return None
