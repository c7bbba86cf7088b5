"""`triforce generate --prompts FILE`'s use case: many prompts decoded as one batch (the batching
itself is triforce.app.batch_generate); texts in input order, or one JSON object.

Any number of prompts runs in bounded memory: the file is read a line at a time, once to check
it, once (with the model's tokenizer, a progress bar shown) for the lengths the memory plan needs,
and once more as rows free up, each prompt tokenized when its row starts. Each result is printed
as soon as it and every one before it have finished (the --json object too is written result by
result); only finished results waiting for an earlier one are held."""
from __future__ import annotations

import json
import sys
from array import array

from tqdm import tqdm

from triforce.app.batch_generate import BatchRow, decode_stream, fit_batch, row_json
from triforce.app.batch_tally import batch_summary
from triforce.app.progress import prefill_bar
from triforce.app.prompts_file import read_prompts
from triforce.errors import UserError


def prompt_lengths(encoded, count: int, context: int) -> array:
    """The token count of each of `count` encoded prompts, each checked to leave room in the
    context: 4 bytes a prompt, for the plan and the summary."""
    lengths = array("I")
    with tqdm(total=count, desc="reading prompts", unit="prompt", file=sys.stderr, disable=None, leave=False) as bar:
        for number, ids in enumerate(encoded, 1):
            if not ids:
                raise UserError(f"prompt {number} is empty after tokenisation")
            if len(ids) >= context:
                raise UserError(f"prompt {number} has {len(ids)} tokens but the context is {context} tokens")
            lengths.append(len(ids))
            bar.update(1)
    return lengths


def run_generate_batch(config, prompts_file: str, batch_size: int | None, as_chat: bool, params,
                       max_new_tokens: int, ignore_eos: bool, as_json: bool) -> None:
    """Check every line, load, tokenize for the plan, then decode in rows as they free up."""
    from triforce.app.llm import LLM

    count = sum(1 for _ in read_prompts(prompts_file))  # every line checked before the model loads
    if not count:
        raise UserError(f"prompts file '{prompts_file}' holds no prompts")
    llm = LLM.from_config(config)
    runtime = llm.runtime
    lm, context = runtime.lm, runtime.context

    def encoded():
        for prompt in read_prompts(prompts_file):
            yield llm.encode(prompt, as_chat)

    lengths = prompt_lengths(encoded(), count, context)
    clipped = sum(n + max_new_tokens > context for n in lengths)
    if clipped:
        print(f"note: {clipped} prompt(s) get fewer than {max_new_tokens} new tokens, to stay within the "
              f"{context}-token context", file=sys.stderr)
    max_len = min(context, max(lengths) + max(max_new_tokens, 1))
    rows, run = fit_batch(runtime, max_len, count, batch_size)
    if not as_json:
        runtime.say_attention()
        if run.method_line() is not None:
            print(run.method_line(), file=sys.stderr)
        print(f"{count} prompts, {rows} at a time, method {run.spec.method}", file=sys.stderr)
    printer = _InOrder(lm.tokenizer, lengths, run.spec.method, as_json)
    stop_ids = frozenset() if ignore_eos else lm.eos_ids
    prefill = prefill_bar(sum(lengths) - count, desc="prefill (all prompts)")
    work = ((ids, min(max_new_tokens, context - len(ids))) for ids in encoded())
    with tqdm(total=count, unit="prompt", file=sys.stderr, disable=None, leave=False) as bar:
        def finished(row: BatchRow) -> None:
            bar.update(1)
            printer.add(row, bar)

        try:
            outcome = decode_stream(runtime, work, params, stop_ids, rows, run, max_len, finished,
                                    on_prefill=prefill.update)
        finally:
            prefill.close()
        for never_ran in printer.finish(bar):  # prompts an interrupt kept from running
            outcome.tally.add(never_ran)
    summary = batch_summary(outcome)
    from triforce.app.threads import threads_in_use

    summary.update(method=run.spec.method, model=str(lm.path), dtype=str(lm.dtype).removeprefix("torch."),
                   threads=threads_in_use(), device=str(lm.device), attention=runtime.attn_name,
                   method_choice=run.method_json(), plan=run.plan.to_json())
    if as_json:
        print(f'], "batch": {json.dumps(summary)}}}', flush=True)
        return
    acceptance = ""
    if summary["acceptance_rates"]:
        acceptance = (f", acceptance {summary['acceptance_rates']}, "
                      f"{summary['mean_tokens_per_full_verify']} tokens per full verify")
    print(f"[{summary['prompts']} prompts, {summary['new_tokens']} tokens in {summary['time_s']} s: "
          f"{summary['throughput_tok_s']} tok/s, {summary['latency_ms_per_token']} ms per token per sequence, "
          f"batch size {rows}, {summary['rows_per_pass']} rows per forward pass{acceptance}]", file=sys.stderr)


class _InOrder:
    """Prints each prompt's result once it and every prompt before it have finished: text with a
    heading, or (as_json) one element of the "results" list of the JSON object, whose opening it
    prints first. Holds only the finished rows still waiting for an earlier one."""

    def __init__(self, tokenizer, lengths, method: str, as_json: bool):
        self.tokenizer, self.lengths, self.method, self.as_json = tokenizer, lengths, method, as_json
        self.waiting: dict[int, BatchRow] = {}
        self.next = 0
        if as_json:
            print('{"results": [', end="", flush=True)

    def add(self, row: BatchRow, bar) -> None:
        self.waiting[row.index] = row
        while self.next in self.waiting:
            self._show(self.waiting.pop(self.next), bar)

    def finish(self, bar):
        """After an interrupt: the rest, those that never ran marked so (and yielded)."""
        while self.next < len(self.lengths):
            row = self.waiting.pop(self.next, None)
            if row is None:
                row = BatchRow(self.next, self.lengths[self.next], None)
                yield row
            self._show(row, bar)

    def _show(self, row: BatchRow, bar) -> None:
        self.next += 1
        if self.as_json:
            sep = ", " if self.next > 1 else ""
            print(sep + json.dumps(row_json(self.tokenizer, row, self.method)), end="", flush=True)
            return
        if row.result is None:
            bar.write(f"=== prompt {self.next} (not run: interrupted) ===", file=sys.stdout)
            return
        text = self.tokenizer.decode(row.result.tokens, skip_special_tokens=True)
        bar.write(f"=== prompt {self.next} ({row.prompt_tokens} tokens, stopped by "
                  f"{row.result.stopped_by}) ===\n{text}", file=sys.stdout)
