"""The drafting tiers' CUDA graphs on a simulated card, captured and replayed under the capture
guard (card_tensors.FakeCudaGraph): every step a graph holds, for every architecture family and for
float and block-quantized weights, makes no host sync and no tensor from Python data, and a graph
that fails to capture fails the test (graph_failed is reported in the JSON); the tokens equal the
eager run's."""
import pytest

from card_tensors import CaptureViolation, CardTensors
from cli_json import run_json

PROMPT = "the cat sat on the mat. the cat sat on the hat. the cat and the dog sat on the log. the cat sat on"


def generate(capsys, card, folder, *flags):
    with card.placement():
        return run_json(capsys, "generate", "--model", folder, "--prompt", PROMPT, "--device", "cuda",
                        "--max-new-tokens", "10", "--budget", "48", "--chunk-size", "4", "--temperature", "0",
                        "--json", *flags)


@pytest.fixture
def graphs(card, monkeypatch):
    return card.install_graphs(monkeypatch)


def assert_all_replayed(report):
    assert report["drafting_runner"] == "graph"
    assert report["graphs"], "no drafting tier ran through the graph runner"
    for tier, runner in report["graphs"].items():
        assert runner["graph_failed"] is None, (tier, runner["graph_failed"])
        assert runner["replays"] > 0, (tier, runner)  # prefills longer than a graph run eagerly


@pytest.mark.parametrize("family", ["llama-mha", "llama-gqa", "mistral", "qwen2", "qwen3", "llama3-rope", "phi4-mini",
                                    "gemma3"])
def test_every_family_captures_its_drafting_tiers(capsys, graphs, tiny_model_dir, family):
    folder = str(tiny_model_dir(family, max_position_embeddings=512))
    draft = str(tiny_model_dir(family, seed=7, num_layers=1, hidden_size=32, max_position_embeddings=512))
    report = generate(capsys, graphs, folder, "--method", "triforce", "--draft", draft)
    assert_all_replayed(report)
    # one capture stream per graphed tier, not one per graph: a stream holds a cuBLAS workspace of
    # its own, which the plan counts once a tier (issue 74: the H200 peaked 0.42 GiB over its plan)
    assert graphs.streams_made == len(report["graphs"]), graphs.streams_made
    eager = generate(capsys, graphs, folder, "--method", "triforce", "--draft", draft, "--no-graphs")
    assert report["tokens"] == eager["tokens"]


def test_graphs_are_captured_before_the_first_request(capsys, graphs, tiny_model_dir, monkeypatch):
    """Issue 73: the first token after a 32K prefill took 3.2 s on the H200, the drafting tiers'
    graphs captured inside it; they are captured when the engine is built, before any prompt."""
    from triforce.decoding import engine, graph_runner

    folder = str(tiny_model_dir("llama-gqa", max_position_embeddings=512))
    phases, captures = [], []
    capture, set_sequence = graph_runner.TierRunner._capture, engine.Engine.set_sequence

    def counted_capture(self, view):
        captures.append(phases[-1] if phases else "built")
        return capture(self, view)

    def started(self, *args, **kwargs):
        phases.append("request")
        return set_sequence(self, *args, **kwargs)

    monkeypatch.setattr(graph_runner.TierRunner, "_capture", counted_capture)
    monkeypatch.setattr(engine.Engine, "set_sequence", started)
    report = generate(capsys, graphs, folder, "--method", "triforce", "--draft", "lookup")
    assert_all_replayed(report)
    assert captures and set(captures) == {"built"}, captures
    assert report["engine_s"] > 0  # where a one-shot generate reports their time (before time_s)


@pytest.mark.parametrize("method", ["ar", "triforce"])
def test_the_full_tier_is_captured_where_attention_reads_only_filled_entries(capsys, graphs, tiny_model_dir,
                                                                            monkeypatch, method):
    """Issue 73: the target's decoding steps and verifies replay graphs too (about 130 launches a
    forward on a card, each paid from Python), with no host sync inside, where the attention stops
    at the filled entries as flash-attn's kv-cache kernel does (a stand-in here); with SDPA, whose
    fixed path reads the whole buffer (a chat's is the whole context), the full tier stays eager."""
    from triforce import kernels
    from triforce.kernels.attention import SdpaAttention

    folder = str(tiny_model_dir("llama-gqa", max_position_embeddings=512))
    flags = ("--method", method) + (("--draft", "lookup") if method == "triforce" else ())
    plain = generate(capsys, graphs, folder, *flags)
    assert "full" not in plain["graphs"]

    class Bounded(SdpaAttention):
        name = "bounded"

        def fixed_reads_filled_only(self, k_cache):
            return True

    monkeypatch.setattr(kernels, "select_attention", lambda choice, device: (Bounded(), "attention: bounded"))
    report = generate(capsys, graphs, folder, *flags)
    assert_all_replayed(report)
    assert report["graphs"]["full"]["replays"] > 0 and report["graphs"]["full"]["eager_runs"] == 0
    assert report["tokens"] == plain["tokens"]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["q8_0", "q4_k"])
def test_block_quantized_weights_capture_their_drafting_tiers(capsys, graphs, tiny_model_dir, kind):
    """The quantized embedding de-quantizes its rows inside the graph (it once built a constant
    tensor from Python data at every pass, which a capture refuses)."""
    pytest.importorskip("triton")
    folder = str(tiny_model_dir("llama-gqa", hidden_size=256, num_layers=1, max_position_embeddings=512))
    report = generate(capsys, graphs, folder, "--method", "retrieval", "--quantize", kind, "--dtype", "float32",
                      "--max-new-tokens", "4")
    assert_all_replayed(report)


def test_the_guard_refuses_what_a_capture_refuses():
    import torch
    mode = CardTensors()
    with mode:
        x = torch.ones(4, device="cuda")
        with mode.capture_guard():
            y = x * 2  # device work: fine
            for act in (lambda: y.sum().item(), lambda: bool(y[0] > 1), lambda: y.tolist(),
                        lambda: torch.tensor([0, 4], device="cuda"), lambda: y.to("cpu"),
                        lambda: y[y > 1], lambda: y.nonzero()):
                with pytest.raises(CaptureViolation):
                    act()
        assert y.sum().item() == 8.0  # outside a capture a sync is allowed (and counted)
    assert mode.syncs[-1] == "Tensor.item"
