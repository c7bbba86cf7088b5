"""Progress of long prefills on stderr (never stdout: text and --json go there).

A bar appears only once a prefill has run PROGRESS_DELAY_S seconds, so short prompts print
nothing extra; a 5,761-token prompt on a 2-core CPU (four minutes of prefill) used to print
nothing at all until the first token. Where stderr is not a terminal (a log), the bar redraws
rarely instead of every half second."""
from __future__ import annotations

import sys

PROGRESS_DELAY_S = 2.0


def prefill_bar(total: int, desc: str = "prefill"):
    """A tqdm bar over `total` tokens (update(n) as they are prefilled); close() when done."""
    from tqdm import tqdm

    terminal = sys.stderr.isatty()
    return tqdm(total=total, desc=desc, unit="tok", file=sys.stderr, delay=PROGRESS_DELAY_S, leave=False,
                mininterval=0.5 if terminal else 10.0, dynamic_ncols=terminal)
