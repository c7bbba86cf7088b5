"""Fixtures of the CUDA-semantics layer: simulated pinning and the checked streams fake."""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from checked_streams import CheckedStreams  # noqa: E402


class FakeCudart:
    """cudaHostRegister / cudaHostUnregister that only count (CPU tensors stay as they are)."""

    def __init__(self, fail: bool = False):
        self.fail, self.registered, self.unregistered = fail, [], []

    def cudaHostRegister(self, ptr, size, flags):
        if self.fail:
            return 2  # cudaErrorMemoryAllocation
        self.registered.append((ptr, size))
        return 0

    def cudaHostUnregister(self, ptr):
        self.unregistered.append(ptr)
        return 0


@pytest.fixture
def pinning(monkeypatch):
    """allocate_host pins (registers) on this CPU machine, through a counting stand-in."""
    from triforce.pinned import host_memory

    cudart = FakeCudart()
    monkeypatch.setattr(host_memory, "can_pin", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    return cudart


@pytest.fixture
def checked(pinning, monkeypatch):
    """Every prefetcher made in the test speaks to one CheckedStreams, which watches torch calls."""
    from triforce.offload import prefetcher

    fake = CheckedStreams()
    monkeypatch.setattr(prefetcher, "streams_for", lambda device: fake)
    with fake.watching():
        yield fake
