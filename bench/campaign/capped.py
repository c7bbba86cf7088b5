"""Run a module or a script as `python -m`, with this process's GPU memory capped first.

    python -m triforce.bench.campaign.capped --gb 24 -- -m pytest -q tests/gpu

The cap (torch.cuda.set_per_process_memory_fraction) makes an 80 GB card behave like a 24 GB one
for everything the program allocates through PyTorch, so a run on an H100 shows whether a plan
for a consumer card really fits. A card sold as 24 GB has 24 GiB (an RTX 4090: 24564 MiB), of
which the CUDA context takes its share outside PyTorch: the cap leaves PyTorch the GiB asked for
less this process's context, as that card would (the 2026-11-28 campaign capped at 24 * 10^9
bytes, 0.15 GiB under what the rtx4090-24g profile plans). Without CUDA the cap is skipped and
said so."""
from __future__ import annotations

import os
import runpy
import sys

GIB = 1 << 30


def apply_cap(gb: float) -> str:
    import torch

    if not torch.cuda.is_available():
        return "no CUDA device: memory cap not applied"
    lines = []
    for index in range(torch.cuda.device_count()):
        torch.zeros(1, device=f"cuda:{index}")  # the context exists: what it takes is counted below
        free, total = torch.cuda.mem_get_info(index)
        context = max(0, total - free - torch.cuda.memory_reserved(index))
        allowed = max(0, gb * GIB - context)
        fraction = min(1.0, allowed / total)
        torch.cuda.set_per_process_memory_fraction(fraction, index)
        lines.append(f"cuda:{index} capped to a {gb:g} GiB card: {allowed / GIB:.2f} GiB for PyTorch, the CUDA "
                     f"context holding {context / GIB:.2f} GiB ({fraction:.3f} of {total / GIB:.1f} GiB)")
    return "; ".join(lines)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) < 4 or argv[0] != "--gb" or argv[2] != "--" or argv[3] not in ("-m", "-c"):
        sys.exit("usage: python -m triforce.bench.campaign.capped --gb GB -- (-m MODULE | -c CODE) [ARGS...]")
    print(apply_cap(float(argv[1])), file=sys.stderr, flush=True)
    os.environ["TRIFORCE_CAP_GB"] = argv[1]  # a peer's own process (deepspeed_peer) caps itself alike
    kind, target, rest = argv[3], argv[4], argv[5:]
    if kind == "-c":
        sys.argv = ["-c", *rest]
        exec(compile(target, "<campaign step>", "exec"), {"__name__": "__main__"})
        return
    sys.argv = [target, *rest]
    runpy.run_module(target, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
