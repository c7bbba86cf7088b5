"""`triforce chat`: interactive multi-turn chat with streamed answers."""
from __future__ import annotations

import signal
import sys
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import click

from triforce.app.inputs import is_utf8
from triforce.config import RunConfig
from triforce.cli.options import INT, check_non_negative, run_config, run_options, sampling_of, sampling_options
from triforce.errors import UserError
from triforce.model.sampling_defaults import model_sampling


HELP_TEXT = """commands:
  /load FILE   put a document into the context (prefilled now, with a progress bar)
  /stats       context use and speed
  /reset       forget the conversation
  /help        this text
  /quit        leave (Ctrl-D works too)
Ctrl-C stops the current answer and keeps the session."""


class ProgressBar:
    """tqdm on stderr, created once the number of tokens to prefill is known."""

    def __init__(self, desc: str, min_tokens: int = 256, enabled: bool = True):
        self.desc, self.min_tokens, self.enabled, self.bar = desc, min_tokens, enabled, None

    def total(self, n: int) -> None:
        if self.enabled and n >= self.min_tokens:
            from tqdm import tqdm
            self.bar = tqdm(total=n, desc=self.desc, unit="tok", file=sys.stderr, leave=False)

    def update(self, n: int) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _print_stats(stats: dict, say) -> None:
    for key, value in stats.items():
        say(f"  {key:26s} {value}")


def run_command(chat, line: str, say=print, show_progress: bool = True) -> bool:
    """Handle a /command; returns False when the user wants to leave."""
    name, _, arg = line.partition(" ")
    if name in ("/quit", "/exit"):
        return False
    if name == "/help":
        say(HELP_TEXT)
    elif name == "/stats":
        _print_stats(chat.stats(), say)
    elif name == "/reset":
        chat.reset()
        say("(conversation cleared)")
    elif name == "/load":
        if not arg.strip():
            say("usage: /load FILE")
            return True
        bar = ProgressBar("prefill", min_tokens=0, enabled=show_progress)
        try:
            total = chat.load_document(Path(arg.strip()).expanduser(), bar.update, bar.total)
        finally:
            bar.close()
        say(f"(loaded {arg.strip()}; the context now holds {total} tokens)")
    else:
        say(f"unknown command {name}; /help lists them")
    return True


@click.command()
@run_options(default_method="auto")
@click.option("--system", default=None, help="System prompt.")
@click.option("--max-new-tokens", type=INT, default=512, show_default=True, help="Longest answer, in tokens.")
@sampling_options(None)  # the model's own defaults (triforce.model.sampling_defaults)
@click.option("--tp", type=INT, default=1, show_default=True,
              help="Tensor-parallel ranks (GPUs; gloo processes on a CPU). Rank 0 talks to the terminal and "
                   "keeps idle ranks alive; a rank stuck in one step for TRIFORCE_TP_TIMEOUT_S (900 s) fails.")
def chat(system, max_new_tokens, tp, **flags):
    """Chat with a model in the terminal.

    The KV of earlier turns is kept, so each turn prefills only what is new. Type /help for
    the commands (/load FILE, /stats, /reset, /quit). Ctrl-C stops an answer; Ctrl-D leaves.
    """
    check_non_negative("--max-new-tokens", max_new_tokens)
    if tp < 1:
        raise UserError(f"--tp must be >= 1, got {tp}")
    sampling, config = sampling_of(flags, None), run_config(flags)
    request = ChatRequest(config=config, system=system, max_new_tokens=max_new_tokens, params=sampling)
    from triforce.app.parallel import run_on_ranks
    run_on_ranks(tp, chat_rank, request, config.model, config.device)


@dataclass(frozen=True)
class ChatRequest:
    config: RunConfig
    system: str | None
    max_new_tokens: int
    params: object


def chat_rank(rank: int, world: int, request: ChatRequest) -> None:
    """One tensor-parallel rank: rank 0 talks to the terminal and hands every line to the others."""
    if rank != 0:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0 decides when an answer stops
    run_chat(request, rank, world)


class Console:
    """The terminal as rank 0 sees it; other ranks receive rank 0's lines and print nothing."""

    def __init__(self, rank: int, world: int):
        self.rank, self.world = rank, world
        self.interrupted = False
        # input from a pipe or a file: stdout gets the answers only (no banner, no ">>> " prompts)
        self.piped = rank == 0 and not sys.stdin.isatty()
        self.announcer = None
        if rank == 0 and world > 1:
            from triforce.app.rank_idle import Announcer
            self.announcer = Announcer()

    def say(self, *args, **kwargs) -> None:
        if self.rank == 0:
            print(*args, **kwargs)

    def tell(self, text: str) -> None:
        """What the person at the terminal reads but a script reading stdout should not."""
        self.say(text, file=sys.stderr if self.piped else sys.stdout)

    def read(self) -> str | None:
        """The next line (None at end of input); shared with every rank."""
        line = None
        if self.rank == 0:
            with self.announcer.idle() if self.announcer else nullcontext():  # heartbeats while a person thinks
                line = self._line()
        if self.world > 1:
            from triforce.app.rank_idle import receive
            if self.announcer is None:
                return receive()
            if line is None:
                self.announcer.stop()  # the last announcement: the other ranks leave
            self.announcer.announce(line)
        return line

    def _line(self) -> str | None:
        """Rank 0's next non-empty line from the terminal (None at end of input)."""
        while True:
            try:
                line = input("" if self.piped else ">>> ").strip()
            except EOFError:
                print()
                return None
            except KeyboardInterrupt:
                print()
                continue
            except UnicodeDecodeError:  # a strict-UTF-8 terminal
                line = "\udcff"
            if not is_utf8(line):
                print("(that line is not valid UTF-8 text; nothing was sent)", file=sys.stderr)
                continue
            if line:
                return line

    def stop_requested(self, agree) -> bool:
        """Whether rank 0 saw Ctrl-C since the answer began (asked once per round by every rank)."""
        return bool(agree([int(self.interrupted)])[0])

    def on_sigint(self, signum, frame) -> None:
        self.interrupted = True
        if self.world == 1:  # one process: stop at once, a prefill too; the flag, checked each
            raise KeyboardInterrupt  # round, still stops decoding should native code swallow this


def run_chat(r: ChatRequest, rank: int = 0, world: int = 1) -> None:
    """Load, build the conversation's engine, then answer line after line until Ctrl-D or /quit."""
    from triforce.app.chat import Chat
    from triforce.app.llm import LLM
    from triforce.app.start_steps import start_step

    console = Console(rank, world)
    runtime = LLM.from_config(r.config, rank, world).runtime
    max_len = runtime.context
    stop = lambda: console.interrupted  # noqa: E731  (Ctrl-C seen since the answer began)
    if world > 1:  # every rank asks rank 0 whether Ctrl-C was pressed, once per round
        stop = lambda: console.stop_requested(engine.hooks.agree)  # noqa: E731
    run = runtime.plan(max_len)
    with start_step(f"preparing a {max_len}-token context", rank):
        engine = runtime.engine(max_len, run)
    session = Chat(runtime.lm, max_len, system=r.system, engine=engine, stop_requested=stop)
    sampling = model_sampling(runtime.lm).given(r.params)
    if run.auto is not None:
        console.tell(run.auto.describe())
    try:
        import readline  # noqa: F401  (line editing and history for input())
    except ImportError:
        pass
    console.tell(banner(runtime, session, run.plan, sampling, world))
    while True:
        line = console.read()
        if line is None:
            return
        try:
            if line.startswith("/"):
                if not run_command(session, line, console.say, show_progress=rank == 0):
                    return
                continue
            answer(session, line, console, sampling.params, r.max_new_tokens)
        except UserError as e:
            if rank == 0:
                print(f"error: {e}", file=sys.stderr)
        except KeyboardInterrupt:
            console.say("\n[stopped]")


def banner(runtime, session, plan, sampling, world: int) -> str:
    lm = runtime.lm
    weights = f", weights as {lm.quantized['weights']} blocks" if lm.quantized else ""
    return (f"triforce chat: {lm.path.name} on {lm.device} ({str(lm.dtype).removeprefix('torch.')}{weights}), "
            f"{session.full.max_len}-token context, {session.engine.describe()}, attention {runtime.attn_name}"
            f"{', KV beyond token %d offloaded to host memory' % plan.resident_tokens if plan.offloaded else ''}"
            f"{', tensor-parallel over %d ranks' % world if world > 1 else ''}; "
            f"{sampling.describe()} (--temperature 0: greedy). "
            "/help for commands, Ctrl-D to leave.")


def answer(session, line: str, console: Console, params, max_new_tokens: int) -> None:
    """One answer streamed to the terminal, with a note on why it ended and its speed."""
    from triforce.app.textstream import TextStream

    stream, speaker = TextStream(session.lm.tokenizer), console.rank == 0

    def show(token: int) -> None:
        if speaker:
            sys.stdout.write(stream.push(token))
            sys.stdout.flush()

    bar = ProgressBar("prefill", enabled=speaker)
    previous = None
    console.interrupted = False
    if speaker:  # Ctrl-C sets a flag the engine reads each round (all ranks, under --tp)
        previous = signal.signal(signal.SIGINT, console.on_sigint)
    try:
        result = session.ask(line, params, max_new_tokens, show, bar.update, bar.total)
    finally:
        bar.close()
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
    note = {"interrupt": " [stopped]", "length": " [answer cut at --max-new-tokens]",
            "context": " [context full: /reset]"}.get(result.stopped_by, "")
    console.say(note)
    if result.tokens and result.time_s > 0:  # as llama-cli does, after every answer
        console.say(f"[{len(result.tokens)} tokens, {len(result.tokens) / result.time_s:.1f} tok/s]",
                    file=sys.stderr)
