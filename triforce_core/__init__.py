"""triforce: lossless hierarchical speculative decoding for long-context language models."""
__version__ = "0.1.0"

from triforce.numba_cache import use_versioned_cache  # noqa: E402  (before any kernel is compiled)

use_versioned_cache()
