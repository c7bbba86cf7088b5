"""`triforce chat`: interactive multi-turn chat with streamed answers."""
from __future__ import annotations

import sys
from pathlib import Path

import click

from triforce.cli.options import (build_sampling, build_spec, check_non_negative, device_option,
                                  dtype_option, model_option, offload_options, plan_for_run, resolve_draft,
                                  sampling_options, speculation_options)
from triforce.errors import UserError

HELP_TEXT = """commands:
  /load FILE   put a document into the context (prefilled now, with a progress bar)
  /stats       context use and speed
  /reset       forget the conversation
  /help        this text
  /quit        leave (Ctrl-D works too)
Ctrl-C stops the current answer and keeps the session."""


class ProgressBar:
    """tqdm on stderr, created once the number of tokens to prefill is known."""

    def __init__(self, desc: str, min_tokens: int = 256):
        self.desc, self.min_tokens, self.bar = desc, min_tokens, None

    def total(self, n: int) -> None:
        if n >= self.min_tokens:
            from tqdm import tqdm
            self.bar = tqdm(total=n, desc=self.desc, unit="tok", file=sys.stderr, leave=False)

    def update(self, n: int) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _print_stats(stats: dict) -> None:
    for key, value in stats.items():
        print(f"  {key:26s} {value}")


def run_command(chat, line: str) -> bool:
    """Handle a /command; returns False when the user wants to leave."""
    name, _, arg = line.partition(" ")
    if name in ("/quit", "/exit"):
        return False
    if name == "/help":
        print(HELP_TEXT)
    elif name == "/stats":
        _print_stats(chat.stats())
    elif name == "/reset":
        chat.reset()
        print("(conversation cleared)")
    elif name == "/load":
        if not arg.strip():
            print("usage: /load FILE")
            return True
        bar = ProgressBar("prefill", min_tokens=0)
        try:
            total = chat.load_document(Path(arg.strip()).expanduser(), bar.update, bar.total)
        finally:
            bar.close()
        print(f"(loaded {arg.strip()}; the context now holds {total} tokens)")
    else:
        print(f"unknown command {name}; /help lists them")
    return True


@click.command()
@model_option
@click.option("--system", default=None, help="System prompt.")
@click.option("--max-new-tokens", type=int, default=512, show_default=True, help="Longest answer, in tokens.")
@click.option("--max-context", type=int, default=None,
              help="Context size in tokens (default: the model's own maximum).")
@speculation_options(default_method="ar")
@sampling_options(default_temperature=0.7)
@dtype_option
@device_option
@offload_options
def chat(model, system, max_new_tokens, max_context, method, draft, budget, chunk_size, gamma1, gamma2,
         rebuild_stride, rebuild_threshold, temperature, top_p, top_k, seed, dtype, device, profile, device_budget):
    """Chat with a model in the terminal.

    The KV of earlier turns is kept, so each turn prefills only what is new. Type /help for
    the commands (/load FILE, /stats, /reset, /quit). Ctrl-C stops an answer; Ctrl-D leaves.
    """
    from triforce.chat import Chat
    from triforce.loading import load_model
    from triforce.textstream import TextStream

    check_non_negative("--max-new-tokens", max_new_tokens)
    params = build_sampling(temperature, top_p, top_k, seed)
    spec = build_spec(method, budget, chunk_size, gamma1, gamma2, rebuild_stride, rebuild_threshold)
    lm = load_model(model, dtype=dtype, device=device)
    drafter = resolve_draft(draft, spec, dtype, device)
    context = lm.config.max_position_embeddings
    if max_context is not None and not 1 < max_context <= context:
        raise UserError(f"--max-context must be in 2..{context} (the model's context), got {max_context}")
    from triforce.placement import build_kv_cache

    max_len = max_context or context
    plan = plan_for_run(lm, spec, max_len, profile, device_budget, drafter)
    session = Chat(lm, max_len, system=system, spec=spec, draft=drafter,
                   kv_cache=build_kv_cache(lm, max_len, plan))
    try:
        import readline  # noqa: F401  (line editing and history for input())
    except ImportError:
        pass
    print(f"triforce chat: {lm.path.name} on {lm.device} ({str(lm.dtype).removeprefix('torch.')}), "
          f"{session.session.max_len}-token context, {session.engine.describe()}"
          f"{', KV beyond token %d offloaded to host memory' % plan.resident_tokens if plan.offloaded else ''}. "
          "/help for commands, Ctrl-D to leave.")
    while True:
        try:
            line = input(">>> ")
        except EOFError:
            print()
            return
        except KeyboardInterrupt:
            print()
            continue
        line = line.strip()
        if not line:
            continue
        try:
            if line.startswith("/"):
                if not run_command(session, line):
                    return
                continue
            stream = TextStream(lm.tokenizer)

            def show(token: int) -> None:
                sys.stdout.write(stream.push(token))
                sys.stdout.flush()

            bar = ProgressBar("prefill")
            try:
                result = session.ask(line, params, max_new_tokens, show, bar.update, bar.total)
            finally:
                bar.close()
            note = {"interrupt": " [stopped]", "length": " [answer cut at --max-new-tokens]",
                    "context": " [context full: /reset]"}.get(result.stopped_by, "")
            print(note)
        except UserError as e:
            print(f"error: {e}", file=sys.stderr)
        except KeyboardInterrupt:
            print("\n[stopped]")
