"""Text for benchmarks, traces and long-context prompts, without any download.

natural: a corpus of English technical prose (Python's language reference and the docstrings of
the standard library, NumPy and PyTorch; built by `python -m triforce.bench.make_corpus`) in
which no 64-token span occurs twice, so a prompt cut from it never quotes itself and prompt
lookup drafts only what the text really repeats. 200K tokens of the default model's tokenizer.

held-out: docstrings of the installed transformers, click and numba, which no shipped file holds
(~60K tokens; checked against the corpus by the tests): text --method auto has not seen.

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
PROMPT_KINDS = ("natural", "held-out", "repeated")

_MODULES = ("argparse", "asyncio", "collections", "contextlib", "csv", "dataclasses", "datetime",
            "decimal", "difflib", "email", "enum", "fractions", "functools", "heapq", "http.client",
            "inspect", "itertools", "json", "logging", "mailbox", "multiprocessing", "pathlib", "pickle",
            "queue", "random", "re", "sched", "shutil", "socket", "statistics", "string", "subprocess",
            "tarfile", "tempfile", "textwrap", "threading", "typing", "unittest", "urllib.parse",
            "uuid", "warnings", "weakref", "zipfile")
_HELD_OUT_MODULES = (
    "transformers.configuration_utils", "transformers.modeling_utils", "transformers.tokenization_utils_base",
    "transformers.generation.utils", "transformers.trainer", "transformers.training_args",
    "transformers.pipelines.base", "transformers.generation.configuration_utils", "transformers.modeling_rope_utils",
    "transformers.cache_utils", "transformers.data.data_collator", "transformers.optimization",
    "transformers.feature_extraction_utils", "click.core", "click.types", "click.termui", "click.utils",
    "numba.core.dispatcher", "numba.core.errors", "numba.np.ufunc.parallel")


@lru_cache(maxsize=1)
def natural_text() -> str:
    """The shipped natural-prose corpus (paragraphs separated by blank lines)."""
    with gzip.open(NATURAL_FILE, "rt", encoding="utf-8") as f:
        return f.read()


def stdlib_prose() -> str:
    """Paragraphs from standard-library docstrings, in a fixed order (deterministic)."""
    return _prose(_MODULES, methods=False)


@lru_cache(maxsize=1)
def held_out_prose() -> str:
    """Paragraphs from the docstrings of transformers, click and numba (their classes' methods too),
    in a fixed order: deterministic for the installed versions."""
    return _prose(_HELD_OUT_MODULES, methods=True)


def _prose(modules, methods: bool) -> str:
    paragraphs: list[str] = []
    seen: set[str] = set()
    for name in modules:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        objects = [module] + [obj for _, obj in sorted(vars(module).items())
                              if (inspect.isclass(obj) or inspect.isfunction(obj))
                              and (not methods or getattr(obj, "__module__", "") == name)]
        if methods:
            objects += [m for obj in objects if inspect.isclass(obj) for _, m in sorted(vars(obj).items())
                        if inspect.isfunction(m)]
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
    """About `num_tokens` tokens of `kind` text (natural | held-out | repeated), as text."""
    if kind == "natural":
        return tokenizer.decode(natural_ids(tokenizer, num_tokens, offset))
    if kind == "held-out":
        ids = tokenizer(held_out_prose(), add_special_tokens=False).input_ids
        if num_tokens > len(ids):
            raise UserError(f"the held-out text holds {len(ids)} tokens, fewer than the {num_tokens} asked for")
        return tokenizer.decode(ids[offset:offset + num_tokens])
    if kind == "repeated":
        return tokenizer.decode(repeated_ids(tokenizer, num_tokens))
    raise UserError(f"unknown prompt text '{kind}' (choose {', '.join(PROMPT_KINDS)})")


_tokenized: list = [None, []]  # [tokenizer, its ids of the corpus]: the last one asked for


def _natural_token_ids(tokenizer) -> list[int]:
    """The corpus tokenized once per tokenizer (900 KB take a second or two)."""
    if _tokenized[0] is not tokenizer:
        _tokenized[:] = [tokenizer, tokenizer(natural_text(), add_special_tokens=False).input_ids]
    return _tokenized[1]
