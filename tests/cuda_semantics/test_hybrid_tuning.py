"""On a (simulated) card the hybrid split follows the passes as they run: each layer's CPU half
is timed on the host's clock and its device half by timing events, the share moves after each
pass (offload.hybrid.ShareTuner), and the tokens stay those of the run that streams everything."""
import pytest

from cli_json import run_json
from sync_budget import PROMPT, small_block_profile
from triforce.offload.hybrid import ShareTuner


@pytest.fixture(scope="module")
def folder(tiny_model_dir):
    return str(tiny_model_dir("llama-gqa", max_position_embeddings=1024, num_layers=4))


def test_the_split_follows_the_timed_passes_and_keeps_the_tokens(capsys, card, checked, folder, tmp_path,
                                                                monkeypatch):
    moves = []
    real = ShareTuner.observe

    def observe(self, tokens, layers):
        before = self._share(tokens)
        real(self, tokens, layers)
        moves.append((tokens, len(layers), before, self.shares[tokens]))

    monkeypatch.setattr(ShareTuner, "observe", observe)
    flags = ["generate", "--model", folder, "--prompt", PROMPT, "--device", "cuda", "--max-new-tokens", "12",
             "--ignore-eos", "--json", "--dtype", "float32", "--device-budget", "2.5MB", "--profile",
             small_block_profile(tmp_path), "--threads", "1"]
    with card.placement():
        tuned = run_json(capsys, *flags)
        timed = len(moves)
        streamed = run_json(capsys, *flags, "--no-hybrid")
    assert tuned["plan"]["offloaded"] and tuned["plan"]["hybrid"] and len(moves) == timed  # none timed streaming
    assert tuned["tokens"] == streamed["tokens"]
    assert len(moves) >= 3 and all(tokens == 1 and layers == 4 for tokens, layers, _, _ in moves)
    # here the host's half of a tiny model's few KB takes far longer than the profile's link would
    # for all of it: the CPU's share falls every pass (by a quarter), until it takes no block
    assert all(after == pytest.approx(0.75 * before) for *_, before, after in moves)
