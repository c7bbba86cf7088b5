"""Fixtures of the CUDA-semantics layer: simulated pinning and the checked streams fake."""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from checked_streams import CheckedStreams  # noqa: E402
from fake_card import FakeCard  # noqa: E402


@pytest.fixture
def card(monkeypatch):
    """One simulated 24 GB card behind torch.cuda (tests/cuda_semantics/fake_card.py)."""
    return FakeCard().install(monkeypatch)


@pytest.fixture
def pinning(monkeypatch):
    """allocate_host pins (registers) on this CPU machine, through the fake card's counting
    CUDA runtime. Only cudart is installed: the rest of torch.cuda stays as it is (no card)."""
    from triforce.pinned import host_memory

    fake = FakeCard()
    monkeypatch.setattr(host_memory, "can_pin", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", fake.cudart)
    return fake.runtime


@pytest.fixture
def checked(pinning, monkeypatch):
    """Every prefetcher made in the test speaks to one CheckedStreams, which watches torch calls."""
    from triforce.offload import prefetcher

    fake = CheckedStreams()
    monkeypatch.setattr(prefetcher, "streams_for", lambda device: fake)
    with fake.watching():
        yield fake
