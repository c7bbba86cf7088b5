"""The GPU campaign's user step on a CPU: the model it makes on the spot loads, chats through its
template, and triforce's greedy float32 tokens equal transformers' own generate (the check the
step makes on the GPU)."""
import json

import pytest

from triforce.bench.user_step import NEW_TOKENS, PROMPT, make_model, transformers_tokens
from triforce.cli.main import main


@pytest.fixture(scope="module")
def user_model(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("user-step") / "random-llama")


def test_greedy_float32_equals_transformers_on_the_made_model(user_model, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--model", str(user_model), "--prompt", PROMPT, "--max-new-tokens", str(NEW_TOKENS),
              "--json", "--dtype", "float32", "--ignore-eos", "--device", "cpu"])
    out, err = capsys.readouterr()
    assert exit_info.value.code == 0, err
    tokens = json.loads(out)["tokens"]
    assert len(tokens) == NEW_TOKENS and tokens == transformers_tokens(user_model, "cpu")


def test_the_made_model_has_a_chat_template(user_model):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(user_model)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert ids[0] == start and ids.count(start) == 2  # the markers are single special tokens
