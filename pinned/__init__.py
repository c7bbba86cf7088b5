"""Pinned host memory: allocation with capacity checks, the host KV store, numba CPU kernels
(gather of selected tokens, CPU attention)."""
from triforce.pinned.cpu_kernels import cpu_attention, gather_blocked
from triforce.pinned.host_kv_store import HostKVStore
from triforce.pinned.host_memory import (HostCapacityError, allocate_host, can_pin, host_available_bytes,
                                          is_registered, pinned_bytes)

__all__ = ["HostKVStore", "HostCapacityError", "allocate_host", "can_pin", "host_available_bytes",
           "cpu_attention", "gather_blocked", "is_registered", "pinned_bytes"]
