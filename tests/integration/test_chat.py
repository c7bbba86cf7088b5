"""Chat bookkeeping: earlier turns' KV is kept, documents load, reset forgets."""
import torch

from triforce.app.chat import Chat
from triforce.config import SamplingParams
from triforce.decoding.full_tier import FullTier

GREEDY = SamplingParams()


def test_second_turn_prefills_only_new_tokens(default_lm):
    chat = Chat(default_lm, 2048)
    chat.ask("What is 2 + 2?", GREEDY, 16)
    total_after_first = len(chat.full.tokens)
    chat.ask("And 3 + 3?", GREEDY, 16)
    assert chat.last_prefill_tokens < 40 < total_after_first + 10
    # The kept KV gives the same next-token logits as a fresh prefill of the whole history.
    history = chat.render(chat.messages, add_generation_prompt=False)
    fresh = FullTier(default_lm, 2048)
    expected = fresh.prefill(history)
    chat.full.cover(history[:-1])
    assert torch.allclose(chat.full.prefill(history[-1:]), expected, atol=1e-3)


def test_load_document_then_ask_about_it(default_lm, tmp_path):
    doc = tmp_path / "note.txt"
    doc.write_text("The secret code word is PINEAPPLE. Remember it.\n")
    chat = Chat(default_lm, 2048)
    loaded = chat.load_document(doc)
    assert loaded > 10
    chat.ask("What is the secret code word?", GREEDY, 24)
    assert chat.last_prefill_tokens < loaded
    assert chat.stats()["turns"] == 1


def test_reset_forgets(default_lm):
    chat = Chat(default_lm, 1024, system="You are terse.")
    chat.ask("Hi", GREEDY, 4)
    chat.reset()
    assert chat.full.tokens == [] and chat.messages == [{"role": "system", "content": "You are terse."}]
