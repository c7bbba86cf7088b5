"""Sampled decoding on CUDA: the verifiers draw their uniforms and residual samples with the
engine's CUDA generator (chat samples by default, so this is a user's first answer). Skipped
without CUDA."""
import pytest
import torch

from triforce.config import SamplingParams, SpecParams
from triforce.decoding.engine import Engine
from triforce.decoding.sampling import make_generator
from triforce.decoding.verification import verify_sampled
from triforce.model.loading import load_model

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

PROMPT = "the cat sat on the mat. the cat sat on the hat. the cat and the dog sat on the log. the cat"


def test_verify_sampled_with_a_cuda_generator():
    g = make_generator(SamplingParams(temperature=0.7, seed=3), "cuda")
    p = torch.softmax(torch.randn(3, 50, device="cuda"), -1)
    q = [torch.softmax(torch.randn(50, device="cuda"), -1), None]
    verdict = verify_sampled([4, 7], q, p, g)
    assert 0 <= verdict.accepted <= 2 and 0 <= verdict.token < 50


@pytest.mark.parametrize("method", ["ar", "triforce", "retrieval", "streaming"])
def test_sampled_generation_runs_on_cuda(tiny_model_dir, method):
    lm = load_model(str(tiny_model_dir("llama-gqa", max_position_embeddings=512)), dtype="bfloat16", device="cuda")
    spec = SpecParams(method=method, gamma1=3, gamma2=5, budget=24, chunk_size=4, sink_tokens=4, rebuild_stride=8)
    ids = lm.tokenizer(PROMPT).input_ids
    engine = Engine(lm, spec, len(ids) + 40, "lookup" if spec.uses_draft else None)
    engine.set_sequence(ids)
    result = engine.generate(30, SamplingParams(temperature=0.7, top_p=0.9, seed=5))
    assert len(result.tokens) == 30
