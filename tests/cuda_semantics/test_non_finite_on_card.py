"""Logits that turn NaN on a card end in the one line they end in on a CPU. A card's multinomial
checks its distribution in the kernel, a device-side assert that loses the process's CUDA context
(the simulated card raises as it would), so a sampled draw there reads a finiteness flag with its
token instead."""
import pytest

from cli_json import run_json
from triforce.cli.main import main


def generate(capsys, card, folder, *flags):
    with card.placement(), pytest.raises(SystemExit) as exit_info:
        main(["generate", "--model", folder, "--prompt", "hello there", "--device", "cuda", "--max-new-tokens", "6",
              "--ignore-eos", *flags])
    return exit_info.value.code, capsys.readouterr().err


@pytest.mark.parametrize("method, draft", [("ar", "none"), ("triforce", "lookup"), ("naive", "model")])
def test_sampled_logits_that_turn_nan_on_a_card_end_in_one_line(capsys, card, tiny_model_dir, overflowing_layer,
                                                                method, draft):
    folder = str(tiny_model_dir("llama-gqa", max_position_embeddings=512))
    draft = draft if draft != "model" else str(tiny_model_dir("llama-gqa", seed=7, num_layers=1, hidden_size=32,
                                                               max_position_embeddings=512))
    code, err = generate(capsys, card, folder, "--method", method, "--draft", draft, "--temperature", "0.8")
    lines = err.strip().splitlines()
    assert code == 1 and "Traceback" not in err and "device-side assert" not in err, err
    assert lines[-1].startswith("triforce: error: the model's logits became NaN or infinite at token"), err


def test_a_sampled_draw_on_a_card_is_the_cpus_draw_and_one_sync(capsys, card, tiny_model_dir):
    folder = str(tiny_model_dir("llama-gqa", max_position_embeddings=512))
    flags = ("generate", "--model", folder, "--prompt", "hello there", "--max-new-tokens", "8", "--ignore-eos",
             "--temperature", "0.8", "--seed", "3", "--method", "ar", "--json")
    on_cpu = run_json(capsys, *flags, "--device", "cpu")
    with card.placement():
        on_card = run_json(capsys, *flags, "--device", "cuda", "--count-syncs")
    assert on_card["tokens"] == on_cpu["tokens"]
    assert on_card["host_syncs"]["total"] <= 8 + 4  # a token's read per step, and the prefill's few
