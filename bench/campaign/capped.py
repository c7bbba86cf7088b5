"""Run a module or a script as `python -m`, with this process's GPU memory capped first.

    python -m triforce.bench.campaign.capped --gb 24 -- -m pytest -q tests/gpu

The cap (torch.cuda.set_per_process_memory_fraction) makes an 80 GB card behave like a 24 GB one
for everything the program allocates through PyTorch, so a run on an H100 shows whether a plan
for a consumer card really fits. Without CUDA the cap is skipped and said so."""
from __future__ import annotations

import runpy
import sys


def apply_cap(gb: float) -> str:
    import torch

    if not torch.cuda.is_available():
        return "no CUDA device: memory cap not applied"
    lines = []
    for index in range(torch.cuda.device_count()):
        total = torch.cuda.get_device_properties(index).total_memory
        fraction = min(1.0, gb * 1e9 / total)
        torch.cuda.set_per_process_memory_fraction(fraction, index)
        lines.append(f"cuda:{index} capped to {gb:g} GB ({fraction:.3f} of {total / 1e9:.1f} GB)")
    return "; ".join(lines)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) < 4 or argv[0] != "--gb" or argv[2] != "--" or argv[3] not in ("-m", "-c"):
        sys.exit("usage: python -m triforce.bench.campaign.capped --gb GB -- (-m MODULE | -c CODE) [ARGS...]")
    print(apply_cap(float(argv[1])), file=sys.stderr, flush=True)
    kind, target, rest = argv[3], argv[4], argv[5:]
    if kind == "-c":
        sys.argv = ["-c", *rest]
        exec(compile(target, "<campaign step>", "exec"), {"__name__": "__main__"})
        return
    sys.argv = [target, *rest]
    runpy.run_module(target, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
