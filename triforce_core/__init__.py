"""triforce: lossless hierarchical speculative decoding for long-context language models.

    from triforce import LLM, SamplingParams
    llm = LLM()
    print(llm.generate("The capital of France is", SamplingParams(max_tokens=16)).text)

The public names are in __all__; importing triforce loads no torch (an LLM does)."""
__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "Result", "Conversation", "UserError", "BadValue", "__version__"]

import os as _os

# Idle kernel threads sleep instead of spinning (read by both OpenMP runtimes, torch's and numba's,
# when they load, so before torch is imported): on a 2-core machine with one other busy program,
# spinning threads left decoding at 0.22-0.31x of its quiet speed, sleeping ones at 0.68-0.80x,
# for 8-14% of quiet speed (bench/history/2026-11-26-natural-text.md). TRIFORCE_THREAD_WAIT=spin keeps
# spinning, for a machine that runs nothing else.
if _os.environ.get("TRIFORCE_THREAD_WAIT", "sleep") != "spin":
    _os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from triforce.numba_cache import use_versioned_cache  # noqa: E402  (before any kernel is compiled)

use_versioned_cache()

from triforce.errors import UserError  # noqa: E402


def __getattr__(name: str):
    """The API's names, imported on first use (triforce.app.llm)."""
    if name == "LLM":
        from triforce.app.llm import LLM
        return LLM
    if name in ("SamplingParams", "Result", "BadValue"):
        from triforce.app import llm_types
        return getattr(llm_types, name)
    if name == "Conversation":
        from triforce.app.llm_modes import Conversation
        return Conversation
    raise AttributeError(f"module 'triforce' has no attribute {name!r}")
