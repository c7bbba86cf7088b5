"""`generate --prompts FILE`: a JSON-lines file of prompts, one {"prompt": "..."} per line, read a
line at a time (never whole: a file of 100,000 prompts costs the memory of one line)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Iterator

from triforce.app.inputs import check_text_file, is_utf8
from triforce.errors import UserError


def prompt_lines(lines: Iterable[str], source: str) -> Iterator[str]:
    """The prompts of JSON lines, in order (blank lines skipped); a bad line is an error naming it."""
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"{source} line {number} is not JSON ({e.msg})") from None
        prompt = item.get("prompt") if isinstance(item, dict) else None
        if not isinstance(prompt, str):
            raise UserError(f'{source} line {number} has no "prompt" string (expected {{"prompt": "..."}})')
        if not is_utf8(prompt):
            raise UserError(f"{source} line {number}: the prompt is not valid Unicode text")
        yield prompt


def parse_prompt_lines(text: str, source: str) -> list[str]:
    """Every prompt of `text` (JSON lines); none at all is an error."""
    prompts = list(prompt_lines(text.splitlines(), source))
    if not prompts:
        raise UserError(f"{source} holds no prompts")
    return prompts


def read_prompts(path: str | Path) -> Iterator[str]:
    """The file's prompts, read as they are asked for (checked first: a file, readable)."""
    source = f"prompts file '{path}'"
    check_text_file(path, "prompts file")
    try:
        with open(path, encoding="utf-8", errors="strict", newline=None) as f:
            try:
                yield from prompt_lines(f, source)
            except UnicodeDecodeError as e:
                raise UserError(f"{source} is not UTF-8 text ({e.reason})") from None
    except OSError as e:
        raise UserError(f"cannot read {source}: {e.strerror}") from None
