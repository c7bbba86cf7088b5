"""A batch's figures added up row by row as rows finish, so a run of any number of prompts keeps
a fixed amount of state: throughput, per-token latency, acceptance per tier."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class BatchTally:
    prompts: int = 0          # rows finished or interrupted before they ran
    new_tokens: int = 0
    latency_s: float = 0.0    # summed over rows with tokens: decoding time / tokens
    latency_rows: int = 0
    first_decode: float | None = None  # perf_counter of the earliest decoding step, and the last end
    last_finish: float | None = None
    proposed: dict = field(default_factory=dict)
    accepted: dict = field(default_factory=dict)
    verifies: int = 0
    emitted: int = 0

    def add(self, row) -> None:
        """A BatchRow (its result None: it never ran)."""
        self.prompts += 1
        result = row.result
        if result is None:
            return
        self.new_tokens += len(result.tokens)
        if result.tokens:
            self.latency_s += result.time_s / len(result.tokens)
            self.latency_rows += 1
        self.first_decode = row.decode_started if self.first_decode is None else min(self.first_decode,
                                                                                     row.decode_started)
        self.last_finish = row.finished if self.last_finish is None else max(self.last_finish, row.finished)
        stats = result.stats
        for name, n in stats.get("proposed", {}).items():
            self.proposed[name] = self.proposed.get(name, 0) + n
            self.accepted[name] = self.accepted.get(name, 0) + stats["accepted"][name]
        if stats.get("full_verifies"):
            self.verifies += stats["full_verifies"]
            self.emitted += len(result.tokens)

    def speculation(self) -> dict:
        """Acceptance per tier and tokens per full verify, pooled over the rows."""
        return {"acceptance_rates": {k: round(self.accepted[k] / n, 4) for k, n in self.proposed.items() if n},
                "mean_tokens_per_full_verify": round(self.emitted / self.verifies, 4) if self.verifies else None}


def batch_summary(outcome) -> dict:
    """Throughput: new tokens of all rows per second from the first row's first decoding step to
    the last row's end (end_to_end: per second of the whole run, prefills included); per-token
    latency: each row's decoding time over its tokens, averaged over the rows."""
    t = outcome.tally
    decoding = t.last_finish - t.first_decode if t.first_decode is not None else 0.0
    return {
        "prompts": t.prompts,
        "batch_size": outcome.batch_size,
        "new_tokens": t.new_tokens,
        "time_s": round(outcome.time_s, 4),
        "throughput_tok_s": round(t.new_tokens / decoding, 3) if decoding > 0 else None,
        "end_to_end_tok_s": round(t.new_tokens / outcome.time_s, 3) if outcome.time_s else None,
        "latency_ms_per_token": round(1000 * t.latency_s / t.latency_rows, 3) if t.latency_rows else None,
        "forward_passes": outcome.passes,
        "rows_per_pass": round(outcome.rows_per_pass, 3),
        **t.speculation(),
    }
