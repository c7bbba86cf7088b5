"""Rebuild the natural-text corpus that benchmarks, traces and needle prompts read
(triforce_core/app/natural_prose.txt.gz, shipped in the package).

    python -m triforce.bench.make_corpus [--out PATH] [--min-tokens 160000]

Prose from what ships with CPython: the language reference's topics (pydoc_data) and the
docstrings of every standard-library module, class and function, in a fixed order. Code
samples, grammar and tables are left out; a paragraph seen before is dropped, and so is every
paragraph that would repeat a 64-token span of the default model's tokenizer anywhere earlier,
so a prompt cut from it never quotes itself. The result depends on the Python version it is
built with, which is why the file ships instead of being built on the user's machine."""
from __future__ import annotations

import bisect
import gzip
import importlib
import inspect
import re
import sys
import warnings
from pathlib import Path

import click

SPAN = 64  # tokens: no span this long occurs twice in the corpus
OUT = Path(__file__).resolve().parent.parent / "triforce_core" / "app" / "natural_prose.txt.gz"
# modules whose import starts something, prints, or needs a display
# installed packages whose docstrings follow the standard library's (all under BSD-style licences)
PACKAGES = ("numpy", "torch")
SKIPPED = {"antigravity", "this", "idlelib", "turtle", "turtledemo", "tkinter", "__hello__", "__phello__",
           "lib2to3", "ensurepip", "pydoc_data", "msilib", "winreg", "winsound", "_msi", "nt"}


def prose(paragraph: str) -> str | None:
    """One paragraph as a line of prose, or None for code, grammar, tables and fragments."""
    lines = paragraph.split("\n")
    if any(line.startswith(("   ", "\t", ">>>", "...", "|", "+--", "*****", "=====", "-----")) for line in lines):
        return None
    text = " ".join(" ".join(lines).split())
    letters = sum(c.isalpha() for c in text)
    if len(text) < 80 or not text[0].isupper() or not text.endswith((".", ":", "?", "!")) \
            or letters < 0.7 * len(text) or "::=" in text:
        return None
    return text


def topic_paragraphs() -> list[str]:
    import pydoc_data.topics

    out = []
    for name in sorted(pydoc_data.topics.topics):
        out += re.split(r"\n\s*\n", pydoc_data.topics.topics[name])
    return out


def stdlib_modules() -> list[str]:
    return sorted(n for n in sys.stdlib_module_names if not n.startswith("_") and n not in SKIPPED)


def package_modules(packages=PACKAGES) -> list[str]:
    """Every public submodule of these installed packages, sorted (for their docstrings)."""
    import pkgutil

    names = []
    for package in packages:
        try:
            root = importlib.import_module(package)
        except ImportError:
            continue
        names.append(package)
        for info in pkgutil.walk_packages(root.__path__, prefix=package + ".", onerror=lambda _: None):
            parts = info.name.split(".")
            if not any(part.startswith("_") or part in ("tests", "testing", "test") for part in parts):
                names.append(info.name)
    return sorted(set(names))


def docstring_paragraphs(names: list[str]) -> list[str]:
    out = []
    for name in names:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                module = importlib.import_module(name)
            except Exception:  # noqa: BLE001 - a module this platform lacks
                continue
        objects = [module] + [obj for _, obj in sorted(vars(module).items(), key=lambda kv: kv[0])
                              if (inspect.isclass(obj) or inspect.isfunction(obj))
                              and getattr(obj, "__module__", None) == module.__name__]
        for obj in objects:
            for member in [obj] + ([m for _, m in sorted(vars(obj).items(), key=lambda kv: kv[0])
                                    if inspect.isfunction(m)] if inspect.isclass(obj) else []):
                out += re.split(r"\n\s*\n", inspect.getdoc(member) or "")
    return out


def build(tokenizer, max_tokens: int, log=print) -> tuple[str, int]:
    """(corpus text, its tokens): prose paragraphs in order until about max_tokens, then, as
    often as needed, every paragraph holding the second occurrence of a SPAN-token window is
    dropped and the whole text tokenized again (a window may cross paragraph joins)."""
    kept, seen = [], set()
    total = 0
    for raw in topic_paragraphs() + docstring_paragraphs(stdlib_modules()) + docstring_paragraphs(package_modules()):
        text = prose(raw)
        if text is None or text in seen:
            continue
        seen.add(text)
        kept.append(text)
        total += len(tokenizer(text, add_special_tokens=False).input_ids) + 1
        if total >= max_tokens * 1.1:  # room for what the repeat check drops
            break
    while True:
        text = "\n\n".join(kept) + "\n"
        encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids, offsets = encoded.input_ids, encoded.offset_mapping
        repeats = repeated_starts(ids)
        if not repeats:
            break
        starts, position = [], 0  # each paragraph's first character
        for paragraph in kept:
            starts.append(position)
            position += len(paragraph) + 2
        doomed = {bisect.bisect_right(starts, offsets[i][0]) - 1 for i in repeats}
        log(f"{len(repeats)} repeated {SPAN}-token windows: dropping {len(doomed)} paragraphs")
        kept = [p for i, p in enumerate(kept) if i not in doomed]
    if len(ids) > max_tokens:  # end on the last whole paragraph within max_tokens
        cut = text.rfind("\n\n", 0, offsets[max_tokens][0])
        text = text[:cut] + "\n"
        ids = tokenizer(text, add_special_tokens=False).input_ids
    return text, len(ids)


def repeated_starts(ids: list[int]) -> list[int]:
    """Starts of the SPAN-token windows that occurred earlier in `ids`."""
    first: dict[tuple, int] = {}
    out = []
    for i in range(len(ids) - SPAN + 1):
        window = tuple(ids[i:i + SPAN])
        if window in first:
            out.append(i)
        else:
            first[window] = i
    return out


@click.command()
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=OUT, show_default=True)
@click.option("--min-tokens", type=int, default=160000, show_default=True,
              help="Fail unless the corpus holds at least this many tokens (128K contexts need ~131K).")
@click.option("--max-tokens", type=int, default=200000, show_default=True, help="Stop once this many are in.")
def main(out: Path, min_tokens: int, max_tokens: int) -> None:
    """Rebuild the corpus from this Python's documentation (see the module docstring)."""
    from triforce.model.loading import load_tokenizer, resolve_model_dir

    tokenizer = load_tokenizer(resolve_model_dir("default"))
    text, tokens = build(tokenizer, max_tokens)
    if tokens < min_tokens:
        raise click.ClickException(f"only {tokens} tokens of prose (asked for {min_tokens})")
    with gzip.GzipFile(out, "wb", mtime=0) as f:  # mtime 0: the same text gives the same bytes
        f.write(text.encode())
    print(f"wrote {out}: {len(text)} characters, about {tokens} tokens (Python {sys.version.split()[0]})")


if __name__ == "__main__":
    main()
