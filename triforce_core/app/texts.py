"""Text for benchmarks, traces and long-context prompts, without any download.

natural: a corpus of English technical prose (Python's language reference and the docstrings of
the standard library, NumPy and PyTorch; built by `python -m triforce.bench.make_corpus`) in
which no 64-token span occurs twice, so a prompt cut from it never quotes itself and prompt
lookup drafts only what the text really repeats. 200K tokens of the default model's tokenizer.

repeated: a 4K-token passage of standard-library docstrings over and over (the older corpus was
doubled only past its 27.5K tokens). A continuation of it recites text the model has read,
which speculation drafts almost perfectly: a best case, and named so wherever it is used."""
from __future__ import annotations

import gzip
import importlib
import inspect
from functools import lru_cache
from pathlib import Path

from triforce.errors import UserError

NATURAL_FILE = Path(__file__).with_name("natural_prose.txt.gz")
REPEAT_UNIT = 4096  # tokens of the repeated text's passage
PROMPT_KINDS = ("natural", "repeated")

_MODULES = ("argparse", "asyncio", "collections", "contextlib", "csv", "dataclasses", "datetime",
            "decimal", "difflib", "email", "enum", "fractions", "functools", "heapq", "http.client",
            "inspect", "itertools", "json", "logging", "mailbox", "multiprocessing", "pathlib", "pickle",
            "queue", "random", "re", "sched", "shutil", "socket", "statistics", "string", "subprocess",
            "tarfile", "tempfile", "textwrap", "threading", "typing", "unittest", "urllib.parse",
            "uuid", "warnings", "weakref", "zipfile")


@lru_cache(maxsize=1)
def natural_text() -> str:
    """The shipped natural-prose corpus (paragraphs separated by blank lines)."""
    with gzip.open(NATURAL_FILE, "rt", encoding="utf-8") as f:
        return f.read()


def stdlib_prose() -> str:
    """Paragraphs from standard-library docstrings, in a fixed order (deterministic)."""
    paragraphs: list[str] = []
    seen: set[str] = set()
    for name in _MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        objects = [module] + [obj for _, obj in sorted(vars(module).items())
                              if inspect.isclass(obj) or inspect.isfunction(obj)]
        for obj in objects:
            doc = inspect.getdoc(obj) or ""
            for para in doc.split("\n\n"):
                para = " ".join(para.split())
                # prose only: sentences, not code samples or tables
                if len(para) > 80 and para[0].isupper() and para.endswith(".") and ">>>" not in para \
                        and para not in seen:
                    seen.add(para)
                    paragraphs.append(para)
    return "\n\n".join(paragraphs)


def natural_ids(tokenizer, num_tokens: int, offset: int = 0) -> list[int]:
    """`num_tokens` tokens of the natural corpus from token `offset` (different offsets give a
    batch's rows different text)."""
    ids = _natural_token_ids(tokenizer)
    if offset + num_tokens > len(ids):
        raise UserError(f"the natural-text corpus holds {len(ids)} tokens of this tokenizer; "
                        f"{num_tokens} from {offset} do not fit (the repeated text has no limit)")
    return ids[offset:offset + num_tokens]


def natural_size(tokenizer) -> int:
    """Tokens of the natural corpus in this tokenizer."""
    return len(_natural_token_ids(tokenizer))


def repeated_ids(tokenizer, num_tokens: int) -> list[int]:
    """The best case: a REPEAT_UNIT-token passage repeated until it holds `num_tokens` tokens."""
    unit = tokenizer(stdlib_prose(), add_special_tokens=False).input_ids[:REPEAT_UNIT]
    return (unit * (num_tokens // len(unit) + 1))[:num_tokens]


def prompt_text(kind: str, tokenizer, num_tokens: int, offset: int = 0) -> str:
    """About `num_tokens` tokens of `kind` text (natural | repeated), as text."""
    if kind == "natural":
        return tokenizer.decode(natural_ids(tokenizer, num_tokens, offset))
    if kind == "repeated":
        return tokenizer.decode(repeated_ids(tokenizer, num_tokens))
    raise UserError(f"unknown prompt text '{kind}' (choose {', '.join(PROMPT_KINDS)})")


_tokenized: list = [None, []]  # [tokenizer, its ids of the corpus]: the last one asked for


def _natural_token_ids(tokenizer) -> list[int]:
    """The corpus tokenized once per tokenizer (900 KB take a second or two)."""
    if _tokenized[0] is not tokenizer:
        _tokenized[:] = [tokenizer, tokenizer(natural_text(), add_special_tokens=False).input_ids]
    return _tokenized[1]
