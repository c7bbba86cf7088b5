"""The fake card keeps torch's contracts: every fake has its real function's signature, and fake
and real refuse the same device values (an index-less cuda device where torch needs an index,
a CPU device, a card past the last, a fraction of the wrong type or range).

The real functions are probed on this CUDA-less PyTorch with CUDA's lazy initialisation skipped:
they resolve and check their device in Python before asking the driver, so a call that gets past
that check fails only for want of CUDA, which counts as accepted."""
import contextlib
import inspect

import pytest
import torch
import torch.cuda.memory
import torch.distributed

from fake_card import FakeCard

REAL = {name: getattr(torch.cuda, name) for name in FakeCard.FAKED}
REAL_INIT = torch.distributed.init_process_group


def _params(fn):
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


@pytest.mark.parametrize("name", FakeCard.FAKED)
def test_each_fake_has_the_real_signature(name):
    assert _params(getattr(FakeCard(), name)) == _params(REAL[name]), name


def test_init_process_group_fake_has_the_real_signature():
    assert _params(FakeCard().init_process_group) == _params(REAL_INIT)


@contextlib.contextmanager
def real_functions_past_lazy_init(monkeypatch):
    """torch.cuda's own functions, on one simulated card, with CUDA's initialisation skipped so
    they reach their device checks."""
    card = FakeCard()
    for module in (torch.cuda, torch.cuda.memory):
        for name in ("_lazy_init",):
            if hasattr(module, name):
                monkeypatch.setattr(module, name, lambda: None)
        if hasattr(module, "is_initialized"):
            monkeypatch.setattr(module, "is_initialized", lambda: True)
    for name in ("is_available", "device_count", "current_device"):
        monkeypatch.setattr(torch.cuda, name, getattr(card, name))
    yield


REFUSALS = (ValueError, AssertionError, TypeError)


def _outcome(fn, *args):
    """'refused: <type>' when the device (or argument) check raises; 'accepted' when the call
    got past it (on this PyTorch it then fails for want of CUDA, or returns)."""
    try:
        fn(*args)
    except REFUSALS as e:
        if "not compiled with CUDA" in str(e):
            return "accepted"
        return f"refused: {type(e).__name__}"
    except Exception:  # noqa: BLE001 - past the checks: no CUDA driver here
        return "accepted"
    return "accepted"


DEVICES = [torch.device("cuda"), "cuda", None, torch.device("cuda", 0), "cuda:0", 0, 5, torch.device("cpu")]
PROBED = ["mem_get_info", "memory_reserved", "memory_allocated", "max_memory_allocated", "reset_peak_memory_stats",
          "get_device_properties", "get_device_name", "get_device_capability", "get_per_process_memory_fraction",
          "synchronize", "set_device"]


@pytest.mark.skipif(torch.backends.cuda.is_built(), reason="probes torch's checks on a CUDA-less build only")
@pytest.mark.parametrize("name", PROBED)
def test_fake_and_real_refuse_the_same_devices(monkeypatch, name):
    fake = getattr(FakeCard(), name)
    with real_functions_past_lazy_init(monkeypatch):
        for device in DEVICES:
            if device is None and name == "set_device":
                continue  # set_device(None) is a no-op in some releases and an error in others
            assert _outcome(fake, device) == _outcome(REAL[name], device), (name, device)


@pytest.mark.skipif(torch.backends.cuda.is_built(), reason="probes torch's checks on a CUDA-less build only")
@pytest.mark.parametrize("args", [(0.5, torch.device("cuda")), (0.5, "cuda:0"), (0.5, None), (1, 0), (1.5, 0),
                                  (0.5, torch.device("cpu"))])
def test_memory_fraction_cap_refuses_what_torch_refuses(monkeypatch, args):
    fake = FakeCard().set_per_process_memory_fraction
    with real_functions_past_lazy_init(monkeypatch):
        assert _outcome(fake, *args) == _outcome(REAL["set_per_process_memory_fraction"], *args), args


def test_the_index_less_device_is_refused_where_torch_needs_an_index(card):
    with pytest.raises(ValueError, match="specified index"):
        torch.cuda.get_per_process_memory_fraction(torch.device("cuda"))
    with pytest.raises(ValueError, match="specified index"):
        torch.cuda.set_device("cuda")
    assert torch.cuda.mem_get_info(torch.device("cuda"))[1] == card.total_bytes  # optional there: the current card


def test_a_card_past_the_last_is_refused(card):
    with pytest.raises(AssertionError, match="Invalid device id"):
        torch.cuda.get_device_properties(1)
    with pytest.raises(RuntimeError, match="invalid device ordinal"):
        torch.cuda.mem_get_info("cuda:1")
    with pytest.raises(ValueError, match="out of range"):
        torch.distributed.init_process_group("nccl", device_id=torch.device("cuda", 1))
    with pytest.raises(ValueError, match="with index"):
        torch.distributed.init_process_group("nccl", device_id=torch.device("cuda"))

