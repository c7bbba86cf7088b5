"""Issue 75: the calls people bring from vLLM work where they mean the same: SamplingParams(n=,
logprobs=, seed=, stop=, max_tokens=), llm.generate(prompts, sampling_params), sampling fields as
keywords, and each answer in .outputs[i] (.text, .token_ids, .finish_reason, .logprobs) beside
the Result's own .text. docs/api.md lists what still differs."""
import math

import pytest

PROMPTS = ["The capital of France is", "Once upon a time"]


@pytest.fixture(scope="module")
def models(tiny_model_dir):
    from triforce import LLM

    folder = str(tiny_model_dir("llama-gqa", max_position_embeddings=512))
    common = dict(draft="lookup", dtype="float32", device="cpu")
    return LLM(folder, method="triforce", **common), LLM(folder, method="ar", **common)


def test_a_vllm_script_runs(models):
    from triforce import LLM, SamplingParams

    llm: LLM = models[0]
    sampling_params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=8, n=2, seed=3, ignore_eos=True)
    outputs = llm.generate(PROMPTS, sampling_params)
    for prompt, output in zip(PROMPTS, outputs):
        assert [o.index for o in output.outputs] == [0, 1]
        first = output.outputs[0]
        assert (first.text, first.token_ids, first.finish_reason) == (output.text, output.token_ids, "length")
        assert output.prompt_token_ids == llm.encode(prompt)
        assert all(len(o.token_ids) == 8 and o.logprobs is None for o in output.outputs)
    # answer 0 is the request seeded 3 alone; answer 1 its own seed (the server's choices' rule)
    from triforce.decoding.sampling import choice_seed
    one = llm.generate(PROMPTS[0], sampling_params=SamplingParams(temperature=0.8, top_p=0.95, max_tokens=8, seed=3,
                                                                  ignore_eos=True))
    other = llm.generate(PROMPTS[0], temperature=0.8, top_p=0.95, max_tokens=8, seed=choice_seed(3, 1),
                         ignore_eos=True)
    assert outputs[0].outputs[0].token_ids == one.token_ids and outputs[0].outputs[1].token_ids == other.token_ids


def test_logprobs_are_the_models_whatever_the_method(models):
    """Greedy: each emitted token is the most likely, its log-probability the largest of the
    alternatives; speculative decoding reports what plain decoding does."""
    from triforce import SamplingParams

    params = SamplingParams(max_tokens=10, logprobs=3, ignore_eos=True)
    spec, ar = (m.generate(PROMPTS[0], params).outputs[0] for m in models)
    assert spec.token_ids == ar.token_ids and len(spec.logprobs) == 10
    for token, entry, plain in zip(spec.token_ids, spec.logprobs, ar.logprobs):
        assert token in entry and entry[token] == max(entry.values()) and 3 <= len(entry) <= 4
        assert entry.keys() == plain.keys()
        assert all(math.isclose(entry[t], plain[t], abs_tol=1e-4) for t in entry)
    assert spec.cumulative_logprob == pytest.approx(sum(e[t] for t, e in zip(spec.token_ids, spec.logprobs)))
    batch = models[0].generate(PROMPTS, params)  # asked for logprobs, a list is answered prompt by prompt
    assert batch[0].outputs[0].logprobs == spec.logprobs
    rows = models[0].generate(PROMPTS, max_tokens=4, temperature=0)  # one batch: the prompts' ids kept too
    assert [r.prompt_token_ids for r in rows] == [models[0].encode(p) for p in PROMPTS]


@pytest.mark.parametrize("call, message", [
    (lambda llm, sp: llm.generate("x", maxtokens=3), "unknown keyword 'maxtokens'"),
    (lambda llm, sp: llm.generate("x", sp(), sampling_params=sp()), "give the sampling parameters once"),
    (lambda llm, sp: llm.generate("x", {"max_tokens": 3}), "must be a triforce.SamplingParams"),
    (lambda llm, sp: sp(n=0), "n must be an integer from 1 to 128"),
    (lambda llm, sp: sp(logprobs=21), "logprobs must be None or an integer from 0 to 20"),
    (lambda llm, sp: sp(logprobs=True), "logprobs must be None or an integer"),
    (lambda llm, sp: llm.stream("x", n=2), "stream decodes one answer"),
])
def test_bad_vllm_style_arguments_are_one_line_errors(models, call, message):
    from triforce import BadValue, SamplingParams

    with pytest.raises(BadValue, match=message):
        call(models[0], SamplingParams)
