"""English prose made from what ships with Python (module and class docstrings of the standard
library), for benchmarks and long-context prompts without any download."""
from __future__ import annotations

import importlib
import inspect

_MODULES = ("argparse", "asyncio", "collections", "contextlib", "csv", "dataclasses", "datetime",
            "decimal", "difflib", "email", "enum", "fractions", "functools", "heapq", "http.client",
            "inspect", "itertools", "json", "logging", "mailbox", "multiprocessing", "pathlib", "pickle",
            "queue", "random", "re", "sched", "shutil", "socket", "statistics", "string", "subprocess",
            "tarfile", "tempfile", "textwrap", "threading", "typing", "unittest", "urllib.parse",
            "uuid", "warnings", "weakref", "zipfile")


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


def prose_prompt(tokenizer, num_tokens: int) -> str:
    """Prose that tokenises to about `num_tokens` tokens (repeating the corpus if needed)."""
    corpus = stdlib_prose()
    ids = tokenizer(corpus, add_special_tokens=False).input_ids
    while len(ids) < num_tokens:
        ids = ids + ids
    return tokenizer.decode(ids[:num_tokens])
