"""`triforce generate --prompts FILE`'s use case: many prompts decoded as one batch (the batching
itself is triforce.app.batch_generate); texts in input order, or one JSON object."""
from __future__ import annotations

import json
import sys

from tqdm import tqdm

from triforce.app.batch_generate import (PROMPTS_FILE_BYTES, BatchRow, batch_summary, fit_batch, generate_batch,
                                         parse_prompt_lines)
from triforce.app.inputs import read_text_file
from triforce.app.progress import prefill_bar
from triforce.errors import UserError


def run_generate_batch(config, prompts_file: str, batch_size: int | None, as_chat: bool, params,
                       max_new_tokens: int, ignore_eos: bool, as_json: bool) -> None:
    from triforce.app.runtime import build_runtime
    from triforce.app.generate import encode_prompt

    text = read_text_file(prompts_file, "prompts file", PROMPTS_FILE_BYTES, "a prompts file (256 MiB)")
    prompts = parse_prompt_lines(text, f"prompts file '{prompts_file}'")
    runtime = build_runtime(config)
    lm, context = runtime.lm, runtime.context
    ids = [encode_prompt(lm, p, as_chat, context, config.parse_special_tokens) for p in prompts]
    for number, row in enumerate(ids, 1):
        if not row:
            raise UserError(f"prompt {number} is empty after tokenisation")
        if len(row) >= context:
            raise UserError(f"prompt {number} has {len(row)} tokens but the context is {context} tokens")
    max_new = [min(max_new_tokens, context - len(row)) for row in ids]
    if min(max_new) < max_new_tokens:
        clipped = sum(n < max_new_tokens for n in max_new)
        print(f"note: {clipped} prompt(s) get fewer than {max_new_tokens} new tokens, to stay within the "
              f"{context}-token context", file=sys.stderr)
    max_len = max(len(row) + max(n, 1) for row, n in zip(ids, max_new))
    rows, run = fit_batch(runtime, max_len, len(ids), batch_size)
    if not as_json:
        runtime.say_attention()
        if run.batch is not None:
            print(run.batch.describe(), file=sys.stderr)
        print(f"{len(ids)} prompts, {rows} at a time, method {run.spec.method}", file=sys.stderr)
    printer = _InOrder(lm.tokenizer, len(ids), quiet=as_json)
    stop_ids = frozenset() if ignore_eos else lm.eos_ids
    prefill = prefill_bar(sum(len(row) - 1 for row in ids), desc="prefill (all prompts)")
    with tqdm(total=len(ids), unit="prompt", file=sys.stderr, disable=None, leave=False) as bar:
        def finished(row: BatchRow) -> None:
            bar.update(1)
            printer.add(row, bar)

        try:
            outcome = generate_batch(runtime, ids, max_new, params, stop_ids, rows, run, on_row=finished,
                                     on_prefill=prefill.update)
        finally:
            prefill.close()
        printer.finish(bar)
    summary = batch_summary(outcome)
    from triforce.app.threads import threads_in_use

    summary.update(method=run.spec.method, model=str(lm.path), dtype=str(lm.dtype).removeprefix("torch."),
                   threads=threads_in_use(),
                   device=str(lm.device), attention=runtime.attn_name,
                   method_choice=run.batch.to_json() if run.batch is not None else None, plan=run.plan.to_json())
    if as_json:
        results = [_row_json(lm.tokenizer, r, run.spec.method) for r in outcome.rows]
        print(json.dumps({"results": results, "batch": summary}))
        return
    acceptance = ""
    if summary["acceptance_rates"]:
        acceptance = (f", acceptance {summary['acceptance_rates']}, "
                      f"{summary['mean_tokens_per_full_verify']} tokens per full verify")
    print(f"[{summary['prompts']} prompts, {summary['new_tokens']} tokens in {summary['time_s']} s: "
          f"{summary['throughput_tok_s']} tok/s, {summary['latency_ms_per_token']} ms per token per sequence, "
          f"batch size {rows}, {summary['rows_per_pass']} rows per forward pass{acceptance}]", file=sys.stderr)


def _row_json(tokenizer, row: BatchRow, method: str) -> dict:
    """A prompt's result with the fields of a single run (stopped_by 'interrupt' if it never ran)."""
    result = row.result
    if result is None:
        return {"text": "", "tokens": [], "prompt_tokens": row.prompt_tokens, "new_tokens": 0, "method": method,
                "stopped_by": "interrupt"}
    return {"text": tokenizer.decode(result.tokens, skip_special_tokens=True), "tokens": result.tokens,
            "prompt_tokens": row.prompt_tokens, "new_tokens": len(result.tokens), "method": method,
            "time_s": round(row.time_s, 4), "prefill_s": round(row.prefill_s, 4),
            "decode_s": round(result.time_s, 4),
            "tokens_per_s": round(len(result.tokens) / result.time_s, 3) if result.time_s else None,
            "stopped_by": result.stopped_by, **result.stats}


class _InOrder:
    """Prints each prompt's text once it and every prompt before it have finished."""

    def __init__(self, tokenizer, total: int, quiet: bool):
        self.tokenizer, self.quiet = tokenizer, quiet
        self.rows: list[BatchRow | None] = [None] * total
        self.next = 0

    def add(self, row: BatchRow, bar) -> None:
        self.rows[row.index] = row
        while self.next < len(self.rows) and self.rows[self.next] is not None:
            self._show(bar)

    def finish(self, bar) -> None:
        """After an interrupt: the rest, those that never ran marked so."""
        while self.next < len(self.rows):
            self._show(bar)

    def _show(self, bar) -> None:
        done = self.rows[self.next]
        self.next += 1
        if self.quiet:
            return
        if done is None or done.result is None:
            bar.write(f"=== prompt {self.next} (not run: interrupted) ===", file=sys.stdout)
            return
        text = self.tokenizer.decode(done.result.tokens, skip_special_tokens=True)
        bar.write(f"=== prompt {self.next} ({done.prompt_tokens} tokens, stopped by "
                  f"{done.result.stopped_by}) ===\n{text}", file=sys.stdout)
