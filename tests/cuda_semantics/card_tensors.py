"""What a CUDA card would see, followed on the host tensors that stand for it.

fake_card.FakeCard.placement() keeps tensors bound for the card in host memory (this PyTorch has
no CUDA). This mode labels them (triforce.kernels.device_kind.SIMULATED_CARD): a tensor made on
the card, moved there, or computed from a card tensor is a card tensor. So
- device decisions take CUDA's branch for it (`on_cuda` reads the label; `.device` says cuda:0,
  so `device=x.device` names the card), while the kernels run on the host (`is_cuda` is False);
- every operation that would make the host wait for the card is a sync: `.item()`, `.tolist()`,
  int/float/bool of a card tensor, a copy to the host (unless non_blocking into pinned memory),
  a copy from pageable host memory, a value-dependent shape (nonzero, a boolean mask, ...), a
  tensor made on the card from Python data. Each is reported as torch's sync debug mode reports
  it (a warning in "warn" mode, an error in "error" mode), so `--count-syncs` counts on the
  simulated card with the production counter;
- inside `capture_guard()` (what a CUDA graph captures) each of those raises CaptureViolation.

Pinned host memory is what `pin_memory=True`, `.pin_memory()` or allocate_host's registration
made (and views of it). Torch function modes are per thread: a worker enters the caller's modes
(checked_streams.CheckedStreams.worker), or its work goes unseen."""
from __future__ import annotations

import collections
import contextlib
import sys
import threading
import warnings
import weakref

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from triforce.kernels.device_kind import SIMULATED_CARD
from triforce.pinned.host_memory import is_registered

SYNC_MESSAGE = "called a synchronizing CUDA operation"  # torch's own words (c10/cuda warn_or_error_on_sync)
PINNED = "_triforce_simulated_pinned"
COUNTED = "_triforce_simulated_counted"  # its storage is in CardMemory

# methods whose result the host must wait for when their tensor is on the card
WAITS_FOR_VALUE = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "__complex__", "numpy",
                   "nonzero", "argwhere", "masked_select", "unique", "unique_consecutive", "equal", "allclose",
                   "__repr__", "__format__", "cpu"}
FROM_PYTHON = {"tensor", "as_tensor", "asarray"}
DEVICE_OF = torch.Tensor.device.__get__
CARD = torch.device("cuda", 0)
INDEXING = {"__getitem__", "__setitem__", "index_put_", "index_put"}


_thread = threading.local()


def set_quiet(on: bool) -> None:
    """While on, this thread's torch calls are another fake's own work (checked_streams performing
    a copy it stands for): labelled and placed, never counted as syncs."""
    _thread.quiet = on


class CaptureViolation(RuntimeError):
    """Something a CUDA graph capture would refuse (torch raises RuntimeError there too)."""


def _caller() -> str:
    """The two innermost lines of the runtime's own code on the stack (where a sync came from)."""
    lines, frame = [], sys._getframe(2)
    while frame is not None and len(lines) < 2:
        name = frame.f_code.co_filename
        if "/tests/" not in name and any(f"/{part}/" in name for part in ("triforce_core", "offload", "kernels", "pinned")):
            lines.append(f"{name.rsplit('/', 2)[-2]}/{name.rsplit('/', 1)[-1]}:{frame.f_lineno}")
        frame = frame.f_back
    return " <- ".join(lines) or "?"


def is_card(t) -> bool:
    return isinstance(t, torch.Tensor) and getattr(t, SIMULATED_CARD, False)


def is_pinned(t: torch.Tensor) -> bool:
    base = t._base if t._base is not None else t
    return getattr(t, PINNED, False) or getattr(base, PINNED, False) or is_registered(t)


def _mark(outputs, attribute: str) -> None:
    for t in tree_flatten(outputs)[0]:
        if isinstance(t, torch.Tensor):
            setattr(t, attribute, True)


def _is_cuda(device) -> bool:
    return device is not None and not isinstance(device, torch.dtype) and torch.device(device).type == "cuda"


def _to_target(args, kwargs):
    """The device a Tensor.to call names, if any."""
    if "device" in kwargs:
        return kwargs["device"]
    for a in args[1:]:
        if isinstance(a, (str, torch.device)):
            return a
        if isinstance(a, torch.Tensor):  # .to(other): other's device
            return "cuda" if is_card(a) else "cpu"
    return None


class CardMemory:
    """The card's bytes in use as torch.cuda.memory_allocated counts them: each storage a card
    tensor holds, from the first tensor made on it until the last tensor object on it is gone
    (views and aliases share it), and the peak since the last reset."""

    def __init__(self):
        self._storages: dict[int, list[int]] = {}  # data_ptr -> [bytes, tensor objects on it]
        self.in_use = 0
        self.peak = 0

    def track(self, t: torch.Tensor) -> None:
        if getattr(t, COUNTED, False):
            return
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # no storage (meta, sparse): nothing on the card
            return
        ptr, size = storage.data_ptr(), storage.nbytes()
        if size == 0:
            return
        entry = self._storages.get(ptr)
        if entry is None:
            entry = self._storages[ptr] = [size, 0]
            self.in_use += size
            self.peak = max(self.peak, self.in_use)
        entry[1] += 1
        setattr(t, COUNTED, True)
        weakref.finalize(t, self._release, ptr)

    def _release(self, ptr: int) -> None:
        entry = self._storages[ptr]
        entry[1] -= 1
        if entry[1] == 0:
            del self._storages[ptr]
            self.in_use -= entry[0]

    def reset_peak(self) -> None:
        self.peak = self.in_use


class CardTensors(TorchFunctionMode):
    """The simulated card's torch function mode (see the module's docstring). `sync_level()` gives
    torch's sync debug level (0 off, 1 warn, 2 error), read from the fake card."""

    def __init__(self, sync_level=lambda: 0):
        super().__init__()
        self.sync_level = sync_level
        self.capturing = 0
        self.syncs: list[str] = []  # every sync seen, by operation name (whatever the debug level)
        self.sites: collections.Counter = collections.Counter()  # (operation, the triforce line that made it)
        self.memory = CardMemory()

    @contextlib.contextmanager
    def capture_guard(self):
        """Inside: every sync and every tensor made from Python data on the card raises."""
        self.capturing += 1
        try:
            yield self
        finally:
            self.capturing -= 1

    def _sync(self, what: str) -> None:
        self.syncs.append(what)
        self.sites[(what, _caller())] += 1
        if self.capturing:
            raise CaptureViolation(f"{what} makes the host wait for the card: not allowed in a captured region")
        level = self.sync_level()
        if level == 2:
            raise RuntimeError(f"{SYNC_MESSAGE} ({what})")
        if level == 1:
            warnings.warn(f"{SYNC_MESSAGE} ({what})", UserWarning, stacklevel=3)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func == DEVICE_OF:  # a card tensor says cuda:0, so `device=x.device` names the card
            return CARD if is_card(args[0]) else func(*args)
        kwargs = dict(kwargs or {})
        name = getattr(func, "__name__", "")
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        card_in = any(is_card(t) for t in tensors)
        target = _to_target(args, kwargs) if name == "to" else None
        if "device" in kwargs:
            target = kwargs["device"]
            kwargs["device"] = "cpu" if _is_cuda(target) else target
        pin = bool(kwargs.get("pin_memory"))
        if pin:
            kwargs["pin_memory"] = False
        if name == "to":
            args = tuple("cpu" if isinstance(a, (str, torch.device)) and _is_cuda(a) else a for a in args)
        generator = kwargs.get("generator")
        if isinstance(generator, CardGenerator) and target is not None and not _is_cuda(target):
            raise RuntimeError("Expected a 'cpu' device type for generator but found 'cuda'")
        if not getattr(_thread, "quiet", False):
            self._check_syncs(name, args, kwargs, target, card_in)
        if name == "pin_memory":
            out = args[0].clone()
            _mark(out, PINNED)
            return out
        if name == "is_pinned":
            return is_pinned(args[0])
        if name == "multinomial" and card_in and not bool(torch.isfinite(args[0]).all()):
            # CUDA checks the distribution in the kernel: a device-side assert, and the context is lost
            raise RuntimeError("CUDA error: device-side assert triggered (multinomial of a distribution with "
                               "non-finite entries)")
        result = func(*args, **kwargs)
        to_host = name == "cpu" or (name == "to" and target is not None and not _is_cuda(target))
        if to_host and result is args[0] and is_card(result):
            result = result.clone()  # a copy to the host is a new tensor there (on this CPU, `to` returned self)
            return result
        if name == "__set__" and len(args) == 2 and is_card(args[1]):  # param.data = card tensor
            setattr(args[0], SIMULATED_CARD, True)
        elif _is_cuda(target) or isinstance(generator, CardGenerator) or name == "cuda":
            _mark(result, SIMULATED_CARD)
        elif card_in and target is None and name not in WAITS_FOR_VALUE and not (
                args and result is args[0] and not is_card(result)):  # written in place: where it was
            _mark(result, SIMULATED_CARD)
        if pin:
            _mark(result, PINNED)
        for t in tree_flatten(result)[0]:
            if is_card(t):
                self.memory.track(t)
        return result

    def _check_syncs(self, name, args, kwargs, target, card_in) -> None:
        first = args[0] if args else None
        if name in WAITS_FOR_VALUE and card_in:
            self._sync(f"Tensor.{name}")
        elif name in FROM_PYTHON and _is_cuda(target):
            if self.capturing:
                raise CaptureViolation(f"torch.{name} of Python data onto the card inside a captured region")
            self._sync(f"torch.{name} onto the card")  # a pageable host-to-device copy
        elif name == "to" and isinstance(first, torch.Tensor) and target is not None:
            nonblocking = kwargs.get("non_blocking", False) or any(a is True for a in args[2:])
            if is_card(first) and not _is_cuda(target):
                if not nonblocking:
                    self._sync("Tensor.to(cpu)")
            elif not is_card(first) and _is_cuda(target) and (not nonblocking or not is_pinned(first)):
                self._sync("Tensor.to(card) from pageable memory" if not is_pinned(first) else "blocking Tensor.to(card)")
        elif name == "copy_" and len(args) >= 2 and is_card(args[0]) != is_card(args[1]):
            host = args[1] if is_card(args[0]) else args[0]
            nonblocking = kwargs.get("non_blocking", False) or (len(args) > 2 and args[2] is True)
            if not nonblocking or not is_pinned(host):
                self._sync("copy_ between the card and " + ("pinned" if is_pinned(host) else "pageable")
                           + " host memory" + ("" if nonblocking else " (blocking)"))
        elif name in INDEXING and card_in:
            index = args[1] if len(args) > 1 else None
            if any(isinstance(part, list) for part in (index if isinstance(index, tuple) else (index,))):
                self._sync(f"Tensor.{name} with a Python list index")  # made a host tensor, then copied over
            for t in tree_flatten(index)[0]:
                if isinstance(t, torch.Tensor) and t.dtype == torch.bool and t.dim() > 0:
                    self._sync(f"Tensor.{name} with a boolean mask")  # value-dependent shape
                elif isinstance(t, torch.Tensor) and not is_card(t) and t.dim() > 0:
                    self._sync(f"Tensor.{name} with a host index tensor")
        elif name == "repeat_interleave" and card_in and isinstance(kwargs.get("repeats", args[1] if len(args) > 1 else None),
                                                                  torch.Tensor) and kwargs.get("output_size") is None:
            self._sync("repeat_interleave with tensor repeats")
        elif name == "where" and len(args) == 1 and card_in:
            self._sync("torch.where(condition)")


class CardGenerator(torch.Generator):
    """A generator made for the card: it says cuda:N as a CUDA generator does, and fills host tensors."""

    def __new__(cls, index: int = 0):
        made = super().__new__(cls, device="cpu")
        made._index = index
        return made

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", self._index)


def active() -> CardTensors | None:
    """The CardTensors of the innermost placement on this thread, if any."""
    for mode in reversed(torch.overrides._get_current_function_mode_stack()):
        if isinstance(mode, CardTensors):
            return mode
    return None


class FakeCudaGraph:
    """torch.cuda.CUDAGraph on the simulated card, for triforce's graph runner: capture runs the
    step under the capture guard; replay runs the runner's step again under the guard and writes
    its logits into the tensor the capture returned, as a graph's kernels rewrite their fixed
    addresses. (Replaying the recorded torch calls instead would miss the Triton and numba work
    that no torch function mode sees.)"""

    def __init__(self, mode: CardTensors):
        self.mode, self._guard, self._step = mode, None, None

    def capture_begin(self, pool=None, capture_error_mode: str = "global"):
        caller = sys._getframe(1).f_locals  # TierRunner._capture: its runner and fixed-shape view
        self._step = (caller["self"], caller["view"])
        self._guard = self.mode.capture_guard()
        self._guard.__enter__()

    def capture_end(self):
        self._guard.__exit__(None, None, None)

    def replay(self):
        runner, view = self._step
        out = runner._graphs.get((view.tokens.shape[1], view.queries is not None), (None, None))[1]
        with self.mode.capture_guard(), torch.inference_mode():
            again = runner._forward(view)
            if out is not None:
                out.copy_(again)
