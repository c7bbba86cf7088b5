"""What a sampled token costs outside the model, per call: the host loops (kernels/cpu: penalties,
distribution, gumbel_max) against torch's operators, which the same calls run when each loop's
`takes` is turned off (the reference path the exactness tests compare with):

    triforce bench sampling --vocab 49152 --repeats 200

Chat's settings (temperature 0.2, top-p 0.9, repeat penalty 1.1) on N(0, 4) logits after
`--context` tokens; a seeded choice and a seeded verify each at a new position, as in decoding.
Medians over `--repeats` calls, in microseconds, on this process's threads."""
from __future__ import annotations

import contextlib
import statistics
import time
from unittest import mock

import click

from triforce.bench.harness import emit, output_option


@contextlib.contextmanager
def torch_operators():
    """The sampling steps as torch's operators run them: every host loop declines."""
    from triforce.kernels.cpu import distribution, gumbel_max, penalties

    with contextlib.ExitStack() as stack:
        for module in (distribution, gumbel_max, penalties):
            stack.enter_context(mock.patch.object(module, "takes", lambda *args: False))
        yield


def median_us(call, repeats: int) -> float:
    call()  # compiled and warm
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return round(statistics.median(times) * 1e6, 1)


def steps(vocab: int, context: int, rows: int) -> dict:
    """Each step's call, on inputs made once (a seeded call moves to a new position each time)."""
    import torch

    from triforce.config import CHAT_SAMPLING
    from triforce.decoding.sampling import PositionNoise, penalize, probabilities
    from triforce.decoding.verification import verify_coupled

    generator = torch.Generator(device="cpu").manual_seed(0)
    logits = torch.randn(rows, vocab, generator=generator, device="cpu") * 4
    seq = torch.randint(0, vocab, (context,), generator=generator, device="cpu").tolist()
    penalized = penalize(logits, seq, CHAT_SAMPLING)
    probs = probabilities(penalized, CHAT_SAMPLING)
    noise, position = PositionNoise(0), [context]

    def seeded(n: int):
        position[0] += n
        return verify_coupled(seq[:n - 1], probs[:n], noise, position[0])

    return {"penalties": lambda: penalize(logits[:1], seq, CHAT_SAMPLING),
            "probabilities": lambda: probabilities(penalized[:1], CHAT_SAMPLING),
            "seeded choice": lambda: seeded(1),
            f"seeded verify of {rows} rows": lambda: seeded(rows)}


@click.command()
@click.option("--vocab", type=click.IntRange(65, None), default=49152, show_default=True,
              help="Words a row holds (the default model's 49152; more than the 64 candidates the loops keep).")
@click.option("--context", type=click.IntRange(1, None), default=300, show_default=True,
              help="Tokens before the row: the repeat penalty's window.")
@click.option("--rows", type=click.IntRange(2, 64), default=5, show_default=True, help="Rows of a seeded verify.")
@click.option("--repeats", type=click.IntRange(5, None), default=200, show_default=True)
@output_option
def main(vocab, context, rows, repeats, fmt):
    """A sampled token's steps outside the model: host loops against torch's operators."""
    import torch

    timed = []
    for name, call in steps(vocab, context, rows).items():
        loop = median_us(call, repeats)
        with torch_operators():
            operators = median_us(call, repeats)
        timed.append({"step": name, "loop_us": loop, "torch_us": operators,
                      "torch_over_loop": round(operators / loop, 2)})
    emit(fmt, {"vocab": vocab, "context": context, "sampling": "chat", "threads": torch.get_num_threads()}, timed)


if __name__ == "__main__":
    main()
