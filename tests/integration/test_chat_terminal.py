"""Drive `triforce chat` through a pseudo-terminal, as a person would."""
import os
import signal
import sys

import pytest

pexpect = pytest.importorskip("pexpect")

PROMPT = ">>> "


@pytest.fixture
def chat_process(default_model_dir, tmp_path):
    exe = os.path.join(os.path.dirname(sys.executable), "triforce")
    # a token limit far beyond what streams before the interrupt lands: under load a 48-token
    # answer once ended by length before Ctrl-C arrived, and "[stopped]" never came
    child = pexpect.spawn(exe, ["chat", "--model", "default", "--temperature", "0", "--max-new-tokens", "1024"],
                          encoding="utf-8", timeout=120, dimensions=(40, 200))
    child.expect_exact("repeat penalty 1.1")  # a terminal sees the banner, with chat's default penalty
    child.expect_exact(PROMPT)
    yield child
    if child.isalive():
        child.terminate(force=True)


def test_chat_turns_commands_interrupt_and_eof(chat_process, tmp_path):
    child = chat_process
    child.sendline("/help")
    child.expect("/load FILE")
    child.expect_exact(PROMPT)

    child.sendline("What is the capital of France?")
    child.expect("Paris")
    child.expect_exact(PROMPT)

    child.sendline("/stats")
    child.expect(r"context_tokens\s+(\d+)")
    first_context = int(child.match.group(1))
    assert first_context > 20
    child.expect_exact(PROMPT)

    doc = tmp_path / "doc.txt"
    doc.write_text("Zorblat is a small blue planet orbiting a red star. " * 40)
    child.sendline(f"/load {doc}")
    child.expect(r"loaded .* now holds (\d+) tokens")
    assert int(child.match.group(1)) > first_context + 300
    child.expect_exact(PROMPT)

    # Ctrl-C during an answer stops it and keeps the session.
    child.sendline("Write a very long story about Zorblat, with many chapters.")
    child.expect_exact("chapters.\r\n")  # the terminal's echo of the question
    child.expect(r"\w+ \w+ \w+")  # some answer text is streaming
    child.kill(signal.SIGINT)
    child.expect_exact("[stopped]")
    child.expect_exact(PROMPT)
    child.sendline("/stats")
    child.expect(r"turns\s+2")
    child.expect_exact(PROMPT)

    child.sendline("/reset")
    child.expect("cleared")
    child.expect_exact(PROMPT)
    child.sendline("/stats")
    child.expect(r"context_tokens\s+0")
    child.expect_exact(PROMPT)

    child.sendeof()
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0
