"""Pinned host memory: the host KV store and numba CPU kernels (offload issue)."""
