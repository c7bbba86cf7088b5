"""One shared fake of CUDA cards for the CUDA-semantics tests, keeping torch's contracts.

The only way tests here replace torch.cuda functions. Each fake has the real function's
signature (tests/cuda_semantics/test_fake_card.py checks it, and that fake and real refuse the
same device values) and resolves its device through torch's own `_get_device_index` with the
`optional` flag the real function uses, so an index-less `torch.device("cuda")` is refused
exactly where torch refuses it (`get_per_process_memory_fraction`, `set_device`), an index past
the last card raises as the driver does, and a CPU device is refused.

A lambda that accepts anything once hid a crash of every default command on real GPUs (the
runtime passed `torch.device("cuda")` where torch needs an index)."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.cuda.memory
import torch.distributed
from torch.cuda._utils import _get_device_index

from card_tensors import CardGenerator, CardTensors, FakeCudaGraph, is_card
from triforce.kernels.device_kind import SIMULATED_CARD

GIB = 2**30
NEEDS_INDEX = ("get_per_process_memory_fraction", "set_per_process_memory_fraction", "set_device")


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


@dataclass
class FakeCard:
    """`count` identical cards of `total_bytes`; this process's PyTorch holds `ours_bytes` on each,
    the CUDA context and other programs `others_bytes`."""
    count: int = 1
    total_bytes: int = 24564 << 20
    ours_bytes: int = 0
    others_bytes: int = 600 << 20
    name: str = "Simulated 24 GB card"
    capability: tuple[int, int] = (8, 9)

    pin_fails: bool = False
    p2p: bool = True  # whether the cards reach each other directly (two 4090s do not)

    def __post_init__(self):
        self.current = 0
        self.runtime = FakeCudart(fail=self.pin_fails)
        self.fractions = [1.0] * self.count
        self.calls: list[tuple[str, int]] = []  # (function, resolved index), for tests to read
        self.groups: list[tuple[str | None, torch.device | None]] = []  # init_process_group's
        self.sync_debug_level = 0  # torch.cuda.set_sync_debug_mode's: 0 off, 1 warn, 2 error
        self.tensors: CardTensors | None = None  # the placement's mode while one is entered

    # -- index rules: torch's own helper, then the range the driver checks --------------------
    def _index(self, name: str, device, optional: bool, *, assertion: bool = False) -> int:
        index = _get_device_index(device, optional=optional)
        if not 0 <= index < self.count:
            if assertion:  # get_device_properties asserts in Python before the driver is asked
                raise AssertionError("Invalid device id")
            raise RuntimeError("CUDA error: invalid device ordinal")
        self.calls.append((name, index))
        return index

    # -- the fakes, one per torch.cuda function, each with the real signature -----------------
    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return self.count

    def current_device(self) -> int:
        return self.current

    def set_device(self, device: torch.device | str | int | None) -> None:
        self.current = self._index("set_device", device, optional=False)

    def can_device_access_peer(self, device, peer_device) -> bool:
        index = _get_device_index(device, optional=True)
        peer = _get_device_index(peer_device)
        if not 0 <= index < self.count:
            raise AssertionError("Invalid device id")
        if not 0 <= peer < self.count:
            raise AssertionError("Invalid peer device id")
        return self.p2p and index != peer

    # PyTorch's bytes on the card: `ours_bytes` plus what the placement's tensors hold (CardMemory)
    def _placed(self) -> int:
        return self.tensors.memory.in_use if self.tensors is not None else 0

    def mem_get_info(self, device=None) -> tuple[int, int]:
        self._index("mem_get_info", device, optional=True)
        return self.total_bytes - self.ours_bytes - self._placed() - self.others_bytes, self.total_bytes

    def memory_reserved(self, device=None) -> int:
        self._index("memory_reserved", device, optional=True)
        return self.ours_bytes + self._placed()

    def memory_allocated(self, device=None) -> int:
        self._index("memory_allocated", device, optional=True)
        return self.ours_bytes + self._placed()

    def max_memory_allocated(self, device=None) -> int:
        self._index("max_memory_allocated", device, optional=True)
        return self.ours_bytes + (self.tensors.memory.peak if self.tensors is not None else 0)

    def reset_peak_memory_stats(self, device=None) -> None:
        self._index("reset_peak_memory_stats", device, optional=True)
        if self.tensors is not None:
            self.tensors.memory.reset_peak()

    def get_device_properties(self, device: torch.device | str | int | None = None):
        self._index("get_device_properties", device, optional=True, assertion=True)
        return SimpleNamespace(name=self.name, total_memory=self.total_bytes, major=self.capability[0],
                               minor=self.capability[1], multi_processor_count=128)

    def get_device_name(self, device: torch.device | str | int | None = None) -> str:
        return self.get_device_properties(device).name

    def get_device_capability(self, device: torch.device | str | int | None = None) -> tuple[int, int]:
        return self.get_device_properties(device).major, self.get_device_properties(device).minor

    def get_per_process_memory_fraction(self, device=None) -> float:
        if device is None:
            device = self.current
        return self.fractions[self._index("get_per_process_memory_fraction", device, optional=False)]

    def set_per_process_memory_fraction(self, fraction, device=None) -> None:
        if device is None:
            device = self.current
        index = self._index("set_per_process_memory_fraction", device, optional=False)
        if not isinstance(fraction, float):
            raise TypeError("Invalid type for fraction argument, must be `float`")
        if fraction < 0 or fraction > 1:
            raise ValueError(f"Invalid fraction value: {fraction}. Allowed range: 0~1")
        self.fractions[index] = fraction

    def synchronize(self, device: torch.device | str | int | None = None) -> None:
        self._index("synchronize", device, optional=True)
        if self.tensors is not None:  # the host waits for the card, as a sync debug mode reports it
            self.tensors._sync("torch.cuda.synchronize")

    def empty_cache(self) -> None:
        pass

    def set_sync_debug_mode(self, debug_mode: int | str) -> None:
        levels = {"default": 0, "warn": 1, "error": 2}
        if isinstance(debug_mode, str) and debug_mode not in levels:
            raise RuntimeError("invalid value of debug_mode, expected one of `default`, `warn`, `error`")
        self.sync_debug_level = levels.get(debug_mode, debug_mode)

    def get_sync_debug_mode(self) -> int:
        return self.sync_debug_level

    def cudart(self):
        return self.runtime

    def init_process_group(self, backend=None, init_method=None, timeout=None, world_size=-1, rank=-1, store=None,
                           group_name="", pg_options=None, device_id=None, _ranks=None) -> None:
        """torch.distributed's: records (backend, device_id); a device_id binds the process to one
        card and torch asks for its index and a card that exists."""
        if isinstance(device_id, int):
            device_id = torch.device("cuda", device_id)
        if device_id is not None and device_id.type != "cpu":
            if device_id.index is None:
                raise ValueError("Please use a device_id with index.")
            if device_id.index >= self.count:
                raise ValueError(f"device_id {device_id} is out of range. Please use a device index less than "
                                 f"the number of accelerators available: {self.count}.")
        self.groups.append((backend, device_id))

    FAKED = ("is_available", "device_count", "current_device", "set_device", "can_device_access_peer", "mem_get_info",
             "memory_reserved",
             "memory_allocated", "max_memory_allocated", "reset_peak_memory_stats", "get_device_properties",
             "get_device_name", "get_device_capability", "get_per_process_memory_fraction",
             "set_per_process_memory_fraction", "synchronize", "empty_cache", "cudart", "set_sync_debug_mode",
             "get_sync_debug_mode")

    def install(self, monkeypatch) -> "FakeCard":
        """Put the fakes in place of torch.cuda's functions (and torch.cuda.memory's, which some
        callers reach directly) and of torch.distributed.init_process_group, for the test's duration."""
        for name in self.FAKED:
            fake = getattr(self, name)
            monkeypatch.setattr(torch.cuda, name, fake)
            if hasattr(torch.cuda.memory, name):
                monkeypatch.setattr(torch.cuda.memory, name, fake)
        monkeypatch.setattr(torch.distributed, "init_process_group", self.init_process_group)
        accelerator = getattr(torch, "accelerator", None)
        if hasattr(accelerator, "empty_host_cache"):  # a card has a host cache to empty (torch raises without one)
            monkeypatch.setattr(accelerator, "empty_host_cache", lambda: None)
        return self

    def install_graphs(self, monkeypatch) -> "FakeCard":
        """CUDA graphs on the simulated card (card_tensors.FakeCudaGraph): a runner's capture runs
        under the capture guard, its replays too; streams are the one stream the host runs in order,
        and `streams_made` counts the ones the run made (each holds a cuBLAS workspace on a card)."""
        card = self

        class Stream:
            def __init__(self, device=None, priority=0, **kwargs):
                card.streams_made += 1

            def wait_stream(self, stream):
                pass

        card.streams_made = 0
        default = Stream()
        card.streams_made = 0  # the default stream is the card's own
        monkeypatch.setattr(torch.cuda, "Stream", Stream)
        monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: default)
        monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: object())
        class CUDAGraph(FakeCudaGraph):
            def __init__(self, keep_graph=False):
                super().__init__(card.tensors)

        monkeypatch.setattr(torch.cuda, "CUDAGraph", CUDAGraph)
        return self

    @contextlib.contextmanager
    def placement(self):
        """Tensors bound for the card stay in host memory (this PyTorch has no CUDA), labelled as
        the card's (card_tensors.CardTensors: CUDA's kernel choices, its host syncs, the capture
        guard), so a runtime can be built and run "on the card". The loaded model still says cuda:N.
        Yields the mode."""
        real_generator = torch.Generator

        class PlacedType(type(real_generator)):  # a C type that no mode sees: stood in for
            def __call__(cls, device="cpu"):
                if device is not None and torch.device(device).type == "cuda":
                    return CardGenerator(torch.device(device).index or 0)
                return real_generator(device=device)

            def __instancecheck__(cls, obj):
                return isinstance(obj, real_generator)

        generator = PlacedType("Generator", (real_generator,), {})

        real_parameter = torch.nn.Parameter.__new__
        parameter_slot = vars(torch.nn.Parameter)["__new__"]

        def parameter(cls, data=None, requires_grad=True):  # _make_subclass is seen by no mode
            made = real_parameter(cls, data, requires_grad)
            if is_card(data):
                setattr(made, SIMULATED_CARD, True)
            return made

        torch.Generator = generator
        torch.nn.Parameter.__new__ = staticmethod(parameter)
        self.tensors = CardTensors(lambda: self.sync_debug_level)
        try:
            with self.tensors:
                yield self.tensors
        finally:
            torch.Generator = real_generator
            torch.nn.Parameter.__new__ = parameter_slot
            self.tensors = None
