"""`generate --device cuda --quantize ...` on a simulated card: the model is quantized on the CPU,
its blocks moved to the card as DeviceBlocks and its projections run by the Triton block kernels
(here through Triton's interpreter, on the host tensors the card stands for). Greedy tokens of
every method equal ar on the card, and equal the CPU's numba kernels over the same blocks."""
import json
import math

import pytest

from triforce.cli.main import main

pytest.importorskip("triton")
PROMPT = "the cat sat on the mat. the cat sat on the hat. the cat and the dog sat on the log. the cat sat on"


@pytest.fixture(scope="module")
def folder(tiny_model_dir):
    return str(tiny_model_dir("llama-gqa", max_position_embeddings=512))


@pytest.fixture(scope="module")
def wide_folder(tiny_model_dir):
    return str(tiny_model_dir("llama-gqa", hidden_size=256, num_layers=1,
                               max_position_embeddings=512))  # whole Q4_K super-blocks; one layer: Triton interprets


def generate(capsys, folder, *flags):
    with pytest.raises(SystemExit) as exit_info:  # a later --max-new-tokens wins
        main(["generate", "--model", folder, "--prompt", PROMPT, "--max-new-tokens", "12", "--budget", "48",
              "--chunk-size", "4", "--dtype", "float32", "--temperature", "0", "--json", *flags])
    out, err = capsys.readouterr()
    assert exit_info.value.code == 0, err
    return json.loads(out)


def on_card(capsys, card, folder, *flags, device="cuda"):
    from triforce.kernels.cuda import quant_triton
    calls = []
    real = quant_triton.blocks_linear

    def counted(*args, **kwargs):
        calls.append(args[0].shape[:-1].numel())
        return real(*args, **kwargs)

    quant_triton.blocks_linear = counted
    try:
        with card.placement():
            result = generate(capsys, folder, "--device", device, "--no-graphs", *flags)
    finally:
        quant_triton.blocks_linear = real
    assert result["device"] == "cuda:0"
    return result, calls


# q4_0 takes q4_1's path through the kernel (tests/unit/test_quant_triton.py checks each format);
# the interpreter runs a program in ~20 ms, so the speculative run is q4_1's only
@pytest.mark.slow
@pytest.mark.parametrize("kind,methods,device", [("q4_1", ["triforce"], "cuda"), ("q8_0", [], "cuda:0")])
def test_block_kernels_on_a_card_decode_as_on_the_cpu(capsys, card, folder, kind, methods, device):
    cpu = generate(capsys, folder, "--device", "cpu", "--quantize", kind, "--method", "ar")
    ar, calls = on_card(capsys, card, folder, "--quantize", kind, "--method", "ar", device=device)
    assert ar["quantized"]["weights"] == kind and ar["tokens"] == cpu["tokens"]
    assert 1 in calls and max(calls) > 1  # decoding steps and the prefill both ran the Triton kernels
    for method in methods:  # triforce: lookup -> retrieval tier -> full tier, every tier on the kernels
        spec, _ = on_card(capsys, card, folder, "--quantize", kind, "--method", method, "--draft", "lookup",
                          "--max-new-tokens", "6")  # a verify of every tier; the interpreter's ~20 ms a kernel
        assert spec["tokens"] == ar["tokens"][:6], method
        assert spec["method"] == method


def test_q4_k_on_a_card_holds_its_own_factors_and_decodes_as_on_the_cpu(capsys, card, wide_folder):
    """Q4_K on a GPU keeps sc, m and the super-blocks' d, dmin (19 bytes per 32 weights against the
    CPU's 24) and reads them in the kernel: the same tokens as the CPU's expanded scales."""
    cpu = generate(capsys, wide_folder, "--device", "cpu", "--quantize", "q4_k", "--method", "ar",
                   "--max-new-tokens", "6")
    card_run, calls = on_card(capsys, card, wide_folder, "--quantize", "q4_k", "--method", "ar", "--max-new-tokens", "6")
    assert card_run["tokens"] == cpu["tokens"] and calls
    assert card_run["quantized"]["bytes"] * 24 == cpu["quantized"]["bytes"] * 19


def test_the_warm_up_runs_each_specialised_row_count_before_the_first_token(card, wide_folder, monkeypatch):
    """On a GPU the runtime compiles the Triton kernels' specialisations at start (the interpreter
    here compiles nothing, so the runtime skips it; this calls it with two row counts)."""
    from triforce.app import runtime
    from triforce.kernels.cuda import quant_launch, quant_triton
    from triforce.model.loading import load_model

    monkeypatch.setattr(quant_launch, "WARM_ROWS", (1, 17))
    rows = []
    real = quant_triton.blocks_linear

    def counted(x, *args, **kwargs):
        rows.append(x.reshape(-1, x.shape[-1]).shape[0])
        return real(x, *args, **kwargs)

    monkeypatch.setattr(quant_triton, "blocks_linear", counted)
    with card.placement():
        lm = load_model(wide_folder, dtype="float32", device="cuda", quantize="q8_0")
        runtime.warm_up_blocks(lm)
    assert set(rows) == {1, 17}


def test_a_card_plans_with_its_capabilitys_measured_tiles(capsys, card, wide_folder, monkeypatch):
    """The tile table (quant_launch.measured_tiles) is read for the card's capability (8.9 here)
    and its tiles run every short pass: the tokens stay the CPU's."""
    from triforce.kernels.cuda import quant_triton
    from triforce.kernels.cuda.quant_launch import Tiles

    asked, capabilities = [], []

    class Measured(dict):
        def get(self, key, default=None):
            asked.append(key)
            return Tiles(16, 2, 4, 2, 3)

    def measured(capability):
        capabilities.append(capability)
        return Measured(any="16:2:4:2:3")

    monkeypatch.setattr(quant_triton, "measured_tiles", measured)
    cpu = generate(capsys, wide_folder, "--device", "cpu", "--quantize", "q4_k", "--method", "ar",
                   "--max-new-tokens", "4")
    card_run, _ = on_card(capsys, card, wide_folder, "--quantize", "q4_k", "--method", "ar", "--max-new-tokens", "4")
    assert card_run["tokens"] == cpu["tokens"]
    assert set(capabilities) == {"8.9"} and asked and all(key.startswith("dot q4_k ") for key in asked)


@pytest.mark.slow
def test_a_q4_k_m_file_on_a_card_keeps_q6_k_packed_and_decodes_as_on_the_cpu(capsys, card, tmp_path,
                                                                             default_model_dir):
    """A Q4_K_M file's q6_k tensors (the head, half of attn_v and ffn_down) sit on a card as the
    file's nibbles and bit pairs (26.5 bytes per 32 weights, the CPU's 40) and the Triton kernels
    read them: the same tokens as the CPU's numba kernels over the expanded blocks."""
    from triforce.bench.random_gguf import tensor_plan, write_random_gguf
    from triforce.kernels.cpu.linear.block_formats import DEVICE_BYTES
    from triforce.model.architectures import ARCHITECTURES

    path, fields = tmp_path / "m.gguf", dict(ARCHITECTURES["qwen3-tiny-test"], num_hidden_layers=1)
    write_random_gguf(path, fields, "q4_k_m")
    blocks = [(t.kind, math.prod(t.shape)) for t in tensor_plan(fields, "q4_k_m") if t.kind != "f32"]
    flags = ("--quantize", "gguf", "--method", "ar", "--max-new-tokens", "3", "--ignore-eos")
    cpu = generate(capsys, str(path), "--device", "cpu", *flags)
    card_run, calls = on_card(capsys, card, str(path), *flags)
    assert card_run["quantized"]["weights"] == cpu["quantized"]["weights"] == "q4_k/q6_k"
    assert card_run["tokens"] == cpu["tokens"] and calls
    assert card_run["quantized"]["bytes"] == sum(weights // 32 * DEVICE_BYTES[kind] for kind, weights in blocks)
    assert "q6_k" in dict(blocks) and DEVICE_BYTES["q6_k"] == 26.5
