"""Busy neighbours for a benchmark: N processes that spin a core each, at a given nice level, while
a measurement runs beside them (a desktop always has some; issue 76 measured what one costs).

    --beside quiet,busy,busy-nice19,2-busy,2-busy-nice19

`quiet`: none; `busy`: one at normal priority; `N-busy`: N of them; `-niceK`: at nice K."""
from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
from dataclasses import dataclass

import click

SPIN = "while True: pass"
_FORM = re.compile(r"(?:(\d+)-)?busy(?:-nice(\d+))?")


@dataclass(frozen=True)
class Neighbours:
    name: str
    count: int = 0
    nice: int = 0


def parse_beside(text: str) -> list[Neighbours]:
    """`quiet,busy,busy-nice19,2-busy` -> the conditions in that order (a click.BadParameter if one
    is not of these forms)."""
    out = []
    for item in (part.strip() for part in text.split(",")):
        if item == "quiet":
            out.append(Neighbours(item))
            continue
        match = _FORM.fullmatch(item)
        if not match or int(match[1] or 1) < 1 or int(match[2] or 0) > 19:
            raise click.BadParameter(f"'{item}': give quiet, busy, N-busy, busy-niceK or N-busy-niceK "
                                     "(K from 0 to 19)", param_hint="--beside")
        out.append(Neighbours(item, int(match[1] or 1), int(match[2] or 0)))
    if not out or len({n.name for n in out}) < len(out):
        raise click.BadParameter("give each condition once", param_hint="--beside")
    return out


@contextlib.contextmanager
def running(neighbours: Neighbours):
    """The neighbours spinning for the length of the block, stopped after it (also on an error)."""
    procs = [subprocess.Popen([sys.executable, "-c", SPIN], stdin=subprocess.DEVNULL,
                              preexec_fn=(lambda: os.nice(neighbours.nice)) if neighbours.nice else None)
             for _ in range(neighbours.count)]
    try:
        yield procs
    finally:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait()
