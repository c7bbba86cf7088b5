"""Tensor parallelism as CUDA would run it, checked on a CPU through mocks: each NCCL rank makes
its own GPU current before anything touches CUDA; a rank loads only its share (each checkpoint
tensor sliced on the host); CUDA graph capture succeeds on every rank or on none; cards without
P2P are refused at start where /dev/shm cannot hold NCCL's buffers."""
from collections import Counter

import pytest
import torch
from torch.overrides import TorchFunctionMode

from triforce.decoding.graph_runner import TierRunner
from triforce.model.loading import load_model
from triforce.app import ranks
from triforce.model.tensor_parallel import even_split, shard_model

from fake_card import FakeCard


@pytest.mark.parametrize("rank", [0, 1])
def test_each_nccl_rank_selects_its_own_gpu(monkeypatch, rank):
    card = FakeCard(count=2).install(monkeypatch)
    ranks._join(rank, 2, 29500, "nccl")
    assert card.current == rank and ("set_device", rank) in card.calls
    assert card.groups == [("nccl", torch.device("cuda", rank))]


def test_cards_without_p2p_are_refused_at_start_where_shared_memory_is_short(monkeypatch, capsys, tiny_model_dir):
    """Issue 74: two 4090s have no P2P, NCCL goes through /dev/shm, and a container's 64 MB fails
    mid-start; the command now refuses before any rank starts, in one line naming the fix."""
    import os

    from triforce.app import parallel
    from triforce.cli.main import main

    FakeCard(count=2, p2p=False).install(monkeypatch)
    stats = os.statvfs("/dev/shm")
    monkeypatch.setattr(parallel, "SHM_NEEDED_BYTES", stats.f_bavail * stats.f_frsize + (1 << 30))
    with pytest.raises(SystemExit) as done:
        main(["generate", "--model", str(tiny_model_dir("llama-gqa")), "--prompt", "the cat", "--tp", "2"])
    err = capsys.readouterr().err.strip()
    assert done.value.code == 1 and len(err.splitlines()) == 1, err
    assert "--tp 2: these cards reach each other through shared memory, and /dev/shm has " in err
    assert "--ipc=host or --shm-size=1g" in err
    # cards that reach each other directly need no shared memory; one card needs none either
    parallel.check_shared_memory(2, FakeCard(count=2, p2p=True).can_device_access_peer)
    parallel.check_shared_memory(1, FakeCard(count=2, p2p=False).can_device_access_peer)
    with pytest.raises(AssertionError, match="Invalid peer device id"):  # torch's own contract
        FakeCard(count=2).can_device_access_peer(0, 2)


def test_gloo_ranks_stay_on_the_cpu(monkeypatch):
    card = FakeCard(count=2).install(monkeypatch)
    ranks._join(1, 2, 29500, "gloo")
    assert card.groups == [("gloo", None)] and not any(name == "set_device" for name, _ in card.calls)


class MovedShapes(TorchFunctionMode):
    """Shapes of every tensor moved with .to(device=...) (what reaches the device)."""

    def __init__(self):
        super().__init__()
        self.shapes = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") == "to" and "device" in kwargs:
            self.shapes[tuple(args[0].shape)] += 1
        return func(*args, **kwargs)


@pytest.mark.parametrize("family", ["llama-gqa", "llama-mha", "qwen2"])
@pytest.mark.parametrize("rank", [0, 1])
def test_a_rank_loads_only_its_share(tiny_model_dir, family, rank):
    folder = str(tiny_model_dir(family))
    whole = load_model(folder, dtype="float64", device="cpu")
    shard_model(whole.model, rank, 2)
    with MovedShapes() as moved:
        share = load_model(folder, dtype="float64", device="cpu", shard=(rank, 2))
    expected = dict(whole.model.named_parameters())
    got = dict(share.model.named_parameters())
    assert expected.keys() == got.keys()
    for name, p in expected.items():
        assert torch.equal(p, got[name]), name
    # nothing larger than the share ever went to the device (tied weights are moved once)
    assert moved.shapes == Counter(tuple(p.shape) for p in share.model.parameters())
    assert share.config.num_kv_heads == even_split(whole.config.num_kv_heads, 2)[rank][1]


class CaptureStub(TierRunner):
    """A runner in graph mode on a CPU: capture succeeds or fails as told, replay runs the view."""

    def __init__(self, model, cache, capture_ok: bool, others_ok: bool):
        super().__init__(model, cache, "static")
        self.mode = "graph"
        self.capture_ok = capture_ok
        self.agree = lambda ok: ok and others_ok

    def _capture(self, view):
        if not self.capture_ok:
            raise RuntimeError("operation not permitted when stream is capturing")
        out = self._forward(view)

        class Replay:
            def replay(self_inner):
                with torch.inference_mode():
                    out.copy_(self._forward(view))
        return Replay(), out


def retrieval_tokens(lm, runner=None, graphs="static") -> tuple[list[int], object]:
    """12 greedy tokens of the retrieval method; `runner(model, cache)` makes its tier's runner
    (when the engine is built, which captures its graphs)."""
    from triforce.config import SamplingParams, SpecParams
    from triforce.decoding import tiers
    from triforce.decoding.engine import Engine

    spec = SpecParams(method="retrieval", gamma2=4, budget=24, chunk_size=4, sink_tokens=4)
    ids = lm.tokenizer("the cat sat on the mat. the cat sat on the hat. the cat").input_ids
    with pytest.MonkeyPatch.context() as patch:
        if runner is not None:
            patch.setattr(tiers, "TierRunner", lambda model, cache, mode, agree=None: runner(model, cache))
        engine = Engine(lm, spec, len(ids) + 20, graphs=graphs)
    engine.set_sequence(ids)
    tier = engine.sparse_tiers[0]
    return engine.generate(12, SamplingParams()).tokens, tier.runner


@pytest.fixture(scope="module")
def lm(tiny_model_dir):
    return load_model(str(tiny_model_dir("llama-gqa", max_position_embeddings=512)), dtype="float64", device="cpu")


@pytest.mark.parametrize("capture_ok,others_ok", [(True, False), (False, True), (True, True)])
def test_graph_capture_is_decided_together(lm, capture_ok, others_ok):
    tokens, runner = retrieval_tokens(lm, lambda model, cache: CaptureStub(model, cache, capture_ok, others_ok))
    if capture_ok and others_ok:
        assert runner.graph_failed is None and runner.replays > 0
    else:  # this rank goes eager whichever rank failed
        assert runner.graph_failed is not None and runner.replays == 0 and not runner._graphs
    assert tokens == retrieval_tokens(lm, graphs="off")[0]


def test_graphs_are_captured_up_front(lm):
    captures = []

    def counting(model, cache):
        stub = CaptureStub(model, cache, True, True)
        real_capture = stub._capture
        stub._capture = lambda view: captures.append(view.tokens.shape[1]) or real_capture(view)
        return stub

    tokens, _ = retrieval_tokens(lm, counting)
    assert captures == [1, 2, 3, 4, 5]  # every expected length when the engine is built, none later
    assert tokens == retrieval_tokens(lm, graphs="off")[0]


def test_two_ranks_share_one_card_over_gloo_only_when_asked(monkeypatch, capsys, tiny_model_dir):
    """Issue 74: a GPU lease has one card and NCCL refuses two ranks on one device, so the
    campaign's tp2-one-card step runs `--tp 2` as two gloo ranks on it (TRIFORCE_TP_ONE_CARD=1);
    without the variable one card still refuses `--tp 2` in one line."""
    from triforce.app import parallel
    from triforce.cli.main import main

    FakeCard(count=1, p2p=False).install(monkeypatch)
    folder = str(tiny_model_dir("llama-gqa"))
    with pytest.raises(SystemExit) as done:
        main(["generate", "--model", folder, "--prompt", "the cat", "--tp", "2", "--device", "cuda"])
    err = capsys.readouterr().err.strip()
    assert done.value.code == 1 and err == "triforce: error: --tp 2 needs 2 GPUs but 1 are visible"
    monkeypatch.setenv("TRIFORCE_TP_ONE_CARD", "1")
    parallel.check_world(2, "cuda", folder)  # no P2P between ranks on one card: no shared-memory check either
    assert ranks.backend_for(2) == "gloo" and ranks.backend_for(1) == "nccl"
    assert ranks.select_rank_device(1, "gloo") is None  # both ranks keep the current card
