"""The way in stays short: `triforce generate` reaches the full tier's acceptance test
(verify_greedy) through at most MAX_FRAMES of triforce's own frames, both ends counted
(docs/ARCHITECTURE.md names them). A wrapper slipped in between the command and the engine fails
here."""
import traceback
from pathlib import Path

import pytest

import triforce
from triforce.decoding import engine as engine_module
from cli_json import run_json

MAX_FRAMES = 8
PACKAGE = Path(triforce.__file__).resolve().parent


def own_frames() -> list[str]:
    """The caller's stack, triforce's frames only, outermost first (this test's left out)."""
    frames = traceback.extract_stack()[:-2]
    return [f"{Path(f.filename).resolve().relative_to(PACKAGE)}:{f.name}" for f in frames
            if Path(f.filename).resolve().is_relative_to(PACKAGE)]


@pytest.mark.parametrize("method", ["ar", "triforce"])
def test_generate_reaches_the_acceptance_test_in_at_most_8_frames(method, tiny_model_dir, capsys, monkeypatch):
    stacks = []
    real = engine_module.verify_greedy

    def spy(drafts, rows):
        stacks.append(own_frames() + ["decoding/verification.py:verify_greedy"])
        return real(drafts, rows)

    monkeypatch.setattr(engine_module, "verify_greedy", spy)
    out = run_json(capsys, "generate", "--model", tiny_model_dir("llama-gqa"), "--prompt", "the cat sat. the cat sat.",
                   "--max-new-tokens", 8, "--method", method, "--dtype", "float32", "--json")
    assert out["new_tokens"] == 8 and stacks
    shortest = min(stacks, key=len)  # the full tier's check (a lower tier's is deeper)
    assert shortest[0] == "cli/main.py:main", shortest
    assert len(shortest) <= MAX_FRAMES, " -> ".join(shortest)
