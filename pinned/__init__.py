"""Pinned host memory: allocation with capacity checks, the host KV store, the numba gather of
selected tokens."""
from triforce.pinned.cpu_kernels import gather_blocked
from triforce.pinned.host_arena import HostArena
from triforce.pinned.host_kv_store import HostKVStore
from triforce.pinned.host_memory import (HostCapacityError, allocate_host, can_pin, host_available_bytes,
                                          is_registered, pinned_bytes)

__all__ = ["HostArena", "HostKVStore", "HostCapacityError", "allocate_host", "can_pin", "host_available_bytes",
           "gather_blocked", "is_registered", "pinned_bytes"]
