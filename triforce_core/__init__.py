"""triforce: lossless hierarchical speculative decoding for long-context language models.

    from triforce import LLM, SamplingParams
    llm = LLM()
    print(llm.generate("The capital of France is", SamplingParams(max_tokens=16)).text)

The public names are in __all__; importing triforce loads no torch (an LLM does)."""
__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "Result", "CompletionOutput", "Conversation", "UserError", "BadValue",
           "__version__"]

import os as _os

# Idle kernel threads spin where this process's cores were idle at import, else sleep: decided
# before torch or numba loads OpenMP (triforce.thread_wait; TRIFORCE_THREAD_WAIT=sleep|spin decides).
from triforce.thread_wait import decide as _decide_thread_wait  # noqa: E402

THREAD_WAIT = _decide_thread_wait(_os.environ)

from triforce.numba_cache import use_versioned_cache  # noqa: E402  (before any kernel is compiled)

use_versioned_cache()

from triforce.errors import UserError  # noqa: E402


def __getattr__(name: str):
    """The API's names, imported on first use (triforce.app.llm)."""
    if name == "LLM":
        from triforce.app.llm import LLM
        return LLM
    if name in ("SamplingParams", "Result", "CompletionOutput", "BadValue"):
        from triforce.app import llm_types
        return getattr(llm_types, name)
    if name == "Conversation":
        from triforce.app.llm_modes import Conversation
        return Conversation
    raise AttributeError(f"module 'triforce' has no attribute {name!r}")
