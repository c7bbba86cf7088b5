"""--max-context N --rope-scaling yarn|linear|dynamic: the stretched RoPE is transformers' for that
config, the model runs past its trained context with the same logits as transformers, speculative
decoding stays token-identical to AR there (float32), and the flags refuse what means nothing."""
import json

import pytest
import torch

from triforce.cache.resident import ResidentKVCache
from triforce.cli.main import main
from triforce.errors import UserError
from triforce.model.context_stretch import KINDS, stretch
from triforce.model.hf_config import read_hf_config
from triforce.model.loading import load_model
from triforce.model.rope import RotaryEmbedding

TRAINED = 32  # the tiny model's context; stretched 4x below


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return tiny_model_dir("llama-gqa", max_position_embeddings=TRAINED)


@pytest.mark.parametrize("kind", KINDS)
def test_rope_is_transformers_for_the_stretched_config(default_model_dir, kind):
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    hf = read_hf_config(default_model_dir)
    stretched, context = stretch(hf, 32768, kind)
    assert context == 32768 and stretched.rope_parameters["factor"] == 4.0
    assert hf.rope_parameters["rope_type"] == "default"  # the original config is untouched
    positions = torch.tensor([[0, 7, 8191, 8192, 20000, 32767]])
    cos, sin = RotaryEmbedding(stretched).cos_sin(positions, torch.float32)
    ref_cos, ref_sin = LlamaRotaryEmbedding(stretched)(torch.zeros(1, 6, 64), positions)
    torch.testing.assert_close(cos[:, 0], ref_cos, rtol=0, atol=1e-6)
    torch.testing.assert_close(sin[:, 0], ref_sin, rtol=0, atol=1e-6)


@pytest.mark.parametrize("kind", KINDS)
def test_logits_past_the_trained_context_match_transformers(tiny, kind):
    from transformers import AutoModelForCausalLM

    lm = load_model(str(tiny), dtype="float32", device="cpu", rope_scaling=(4 * TRAINED, kind))
    assert lm.config.max_position_embeddings == 4 * TRAINED
    stretched, _ = stretch(read_hf_config(tiny), 4 * TRAINED, kind)
    ref = AutoModelForCausalLM.from_pretrained(str(tiny), config=stretched, dtype=torch.float32).eval()
    ids = torch.randint(3, lm.config.vocab_size, (3 * TRAINED,), generator=torch.Generator().manual_seed(0)).tolist()
    step = ResidentKVCache(lm.config, len(ids)).step(len(ids))
    got = lm.model(torch.tensor([ids]), step.positions, step)[0]
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0]
    assert (got - expected).abs().max().item() < 1e-4


def run(capsys, *args):
    with pytest.raises(SystemExit) as exit_info:
        main([str(a) for a in args])
    out, err = capsys.readouterr()
    return exit_info.value.code, out, err


@pytest.mark.parametrize("kind", KINDS)
def test_speculation_equals_ar_in_a_stretched_context(capsys, tiny, kind):
    prompt = "the cat sat on the mat. the dog sat on the log. " * 2  # 98 tokens: past the trained 32
    common = ["generate", "--model", tiny, "--prompt", prompt, "--max-context", 4 * TRAINED, "--rope-scaling",
              kind, "--dtype", "float32", "--max-new-tokens", 24, "--ignore-eos", "--json"]
    code, out, err = run(capsys, *common, "--method", "ar")
    assert code == 0, err
    ar = json.loads(out)
    assert ar["prompt_tokens"] > TRAINED and len(ar["tokens"]) == 24
    for method, extra in (("triforce", ["--draft", "lookup"]), ("retrieval", [])):
        code, out, err = run(capsys, *common, "--method", method, *extra, "--budget", 24, "--chunk-size", 4)
        assert code == 0, err
        assert json.loads(out)["tokens"] == ar["tokens"], method


@pytest.mark.parametrize("args, message", [
    (["--rope-scaling", "yarn"], "--rope-scaling needs --max-context"),
    (["--max-context", 4 * TRAINED], f"exceeds the model's {TRAINED}-token context; add --rope-scaling"),
    (["--max-context", TRAINED, "--rope-scaling", "linear"], "is within it"),
    (["--max-context", 1], "--max-context must be >= 2"),
])
def test_context_flags_that_mean_nothing_are_one_line(capsys, tiny, args, message):
    code, _, err = run(capsys, "generate", "--model", tiny, "--prompt", "hi", "--max-new-tokens", 2, *args)
    assert code != 0 and message in err and "Traceback" not in err


def test_a_scaled_model_is_not_scaled_again(tiny_model_dir):
    folder = tiny_model_dir("llama-yarn")
    with pytest.raises(UserError, match="already uses 'yarn' RoPE scaling"):
        load_model(str(folder), dtype="float32", device="cpu", rope_scaling=(1024, "yarn"))


def test_a_model_with_rope_by_layer_kind_is_not_stretched(tiny_model_dir):
    folder = tiny_model_dir("gemma3")
    with pytest.raises(UserError, match="RoPE of their own kinds"):
        load_model(str(folder), dtype="float32", device="cpu", rope_scaling=(1024, "yarn"))
