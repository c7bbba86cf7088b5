"""The one predicate behind every kernel choice that depends on the device: whether a tensor is on
a CUDA card.

Tests run the CUDA branch of those choices with CPU tensors: the simulated card of
tests/cuda_semantics labels the host tensors that stand for card memory with SIMULATED_CARD, so
a test sees which kernel a GPU would have taken (and counts, e.g., float32 fallbacks) while the
kernel itself runs on the tensor's real device. Code that calls a device's own kernel (an aten op
that exists only on CUDA) keeps asking the tensor's real `is_cuda`."""
from __future__ import annotations

import torch

SIMULATED_CARD = "_triforce_simulated_card"  # attribute set on host tensors standing for card memory


def on_cuda(t: torch.Tensor) -> bool:
    """Whether `t` is on a CUDA card (or stands for one in a test)."""
    return t.is_cuda or getattr(t, SIMULATED_CARD, False)


def on_host(t: torch.Tensor) -> bool:
    """Whether `t` is in host memory that the CPU's own kernels may serve (not standing for a card)."""
    return t.device.type == "cpu" and not getattr(t, SIMULATED_CARD, False)
