"""Device discipline: inside `DeviceDiscipline()`, every tensor factory and random draw that
triforce's own code calls must name its device, and a random draw's generator must live on the
device it fills. On a CPU every default is right by accident; on CUDA a factory without a device
makes a CPU tensor beside CUDA ones, and a CUDA generator cannot fill a CPU tensor (the sampled
verifier once drew its uniform that way and failed on the first chat answer)."""
from __future__ import annotations

import os
import traceback

import torch
from torch.overrides import TorchFunctionMode

import triforce
import triforce.bench
import triforce.kernels
import triforce.offload
import triforce.pinned

OURS = tuple(os.path.dirname(os.path.abspath(m.__file__)) + os.sep
             for m in (triforce, triforce.offload, triforce.pinned, triforce.kernels, triforce.bench))
FACTORIES = {"empty", "zeros", "ones", "full", "arange", "rand", "randn", "randint", "randperm", "tensor",
             "empty_strided", "linspace", "eye", "as_tensor"}
DRAWS = {"rand", "randn", "randint", "randperm", "multinomial", "normal_", "uniform_", "bernoulli",
         "exponential_", "random_", "normal", "rand_like", "randn_like"}


class DeviceDisciplineError(AssertionError):
    pass


def _caller() -> traceback.FrameSummary | None:
    """The innermost frame outside torch and this file, if it is triforce's own code."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        name = os.path.abspath(frame.filename)
        if name == os.path.abspath(__file__) or f"{os.sep}torch{os.sep}" in name:
            continue
        return frame if name.startswith(OURS) else None
    return None


class DeviceDiscipline(TorchFunctionMode):
    def __init__(self, collect: bool = False):
        super().__init__()
        self.checked = 0
        self.collect = collect          # gather every violation instead of raising at the first
        self.violations: set[str] = set()

    def _fail(self, message: str) -> None:
        if not self.collect:
            raise DeviceDisciplineError(message)
        self.violations.add(message)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in FACTORIES or name in DRAWS:
            frame = _caller()
            if frame is not None:
                self._check(func, name, args, kwargs, frame)
        return func(*args, **kwargs)

    def _check(self, func, name, args, kwargs, frame) -> None:
        where = f"{frame.filename}:{frame.lineno} ({frame.line})"
        is_method = bool(args) and isinstance(args[0], torch.Tensor) and func is getattr(torch.Tensor, name, None)
        if name in FACTORIES and not is_method and "device" not in kwargs:
            if not (name == "as_tensor" and args and isinstance(args[0], torch.Tensor)):
                self._fail(f"torch.{name} without device= at {where}")
        generator = kwargs.get("generator")
        if generator is not None:
            if is_method or name in ("multinomial", "normal", "bernoulli"):
                target = args[0].device if args and isinstance(args[0], torch.Tensor) else None
            else:
                target = torch.device(kwargs.get("device", "cpu"))
            if target is not None and torch.device(generator.device).type != torch.device(target).type:
                self._fail(f"{name} fills a {target} tensor from a {generator.device} "
                                            f"generator at {where}")
        self.checked += 1
