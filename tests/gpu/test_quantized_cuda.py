"""Block-quantized weights on a real GPU: `generate --device cuda --quantize ...` runs the Triton
block kernels; greedy tokens of triforce equal ar over the same blocks (float32), bfloat16 runs
and the model holds blocks, not floats. Skipped without CUDA."""
import json

import pytest
import torch

from triforce.cli.main import main

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

PROMPT = "the cat sat on the mat. the cat sat on the hat. the cat and the dog sat on the log. the cat sat on"


def generate(capsys, folder, *flags):
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--model", folder, "--prompt", PROMPT, "--max-new-tokens", "24", "--budget", "48",
              "--chunk-size", "4", "--device", "cuda", "--temperature", "0", "--json", *flags])
    out, err = capsys.readouterr()
    assert exit_info.value.code == 0, err
    return json.loads(out)


@pytest.mark.parametrize("kind", ["q4_k", "q4_0", "q8_0"])
def test_quantized_greedy_on_cuda_equals_ar(capsys, tiny_model_dir, kind):
    folder = str(tiny_model_dir("llama-gqa", hidden_size=256, max_position_embeddings=512))
    ar = generate(capsys, folder, "--quantize", kind, "--dtype", "float32", "--method", "ar")
    assert ar["device"].startswith("cuda") and ar["quantized"]["weights"] == kind
    for method in ("triforce", "retrieval"):
        spec = generate(capsys, folder, "--quantize", kind, "--dtype", "float32", "--method", method,
                        "--draft", "lookup")
        assert spec["tokens"] == ar["tokens"], method
    half = generate(capsys, folder, "--quantize", kind, "--dtype", "bfloat16", "--method", "triforce",
                    "--draft", "lookup")
    assert len(half["tokens"]) == 24 and half["dtype"] == "bfloat16"
