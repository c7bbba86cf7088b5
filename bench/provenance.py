"""What a measurement ran on: the commit of the checkout (or TRIFORCE_COMMIT where a copy has no
.git, as on a lent GPU machine)."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path


def git_commit(repo: Path | None = None) -> str:
    """HEAD of the checkout, with '+changes' when tracked files differ from it."""
    if os.environ.get("TRIFORCE_COMMIT"):
        return os.environ["TRIFORCE_COMMIT"]
    try:
        cwd = repo or Path.cwd()
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=cwd,
                               capture_output=True, text=True).stdout.strip()
        return head.stdout.strip() + ("+changes" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown (no git checkout: set TRIFORCE_COMMIT)"


# the CPU features a kernel's speed depends on (the rest of /proc/cpuinfo's flags say nothing here)
VECTOR_FLAGS = frozenset({"sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
                          "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_int8", "asimd", "asimdhp", "sve", "bf16"})


def provenance(repo: Path | None = None) -> dict:
    """What every benchmark's JSON records beside its numbers: the commit, the time (UTC), the
    machine (CPU model and the cores this process may use), its vector flags, torch and the GPU."""
    import datetime
    import platform

    import torch

    from triforce.app.threads import available_cores
    from triforce.kernels.cpu.cpu_flags import host_flags

    model = platform.processor() or platform.machine()
    try:
        model = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"commit": git_commit(repo), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": f"{model}, {available_cores()} cores", "cpu_flags": sorted(host_flags() & VECTOR_FLAGS),
            "torch": torch.__version__, "cuda": torch.version.cuda, "gpu": gpu, "threads": torch.get_num_threads()}
