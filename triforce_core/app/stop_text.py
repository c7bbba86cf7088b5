"""Stop strings over streamed text: the answer ends just before the first stop string, and no
text that could be the start of one is sent until the next tokens decide."""
from __future__ import annotations


class StopText:
    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.held = ""
        self.matched = False

    def feed(self, text: str) -> str:
        """New text of the answer -> what may be sent now (after a match: up to the stop string)."""
        if self.matched:
            return ""
        text = self.held + text
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.matched, self.held = True, ""
            return text[:min(hits)]
        keep = max((k for s in self.stops for k in range(min(len(s) - 1, len(text)), 0, -1)
                    if text.endswith(s[:k])), default=0)
        self.held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep]

    def flush(self) -> str:
        """The answer ended without a stop string: what was held back."""
        held, self.held = self.held, ""
        return held
