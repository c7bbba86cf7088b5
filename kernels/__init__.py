"""Device kernels: attention over a KV view (PyTorch SDPA reference path)."""
from triforce.kernels.attention import attention, causal_mask

__all__ = ["attention", "causal_mask"]
