"""Batches of prompts (`generate --prompts`, triforce.app.batch_generate): every row's greedy
tokens are its own single ar run's (float32), whatever the method, the batch size and the order
in which rows finish; the plan splits the device between the rows."""
import json

import pytest

from triforce.app.batch_generate import fit_batch, generate_batch, row_plan
from triforce.app.prompts_file import parse_prompt_lines
from triforce.app.runtime import build_runtime
from triforce.config import RunConfig
from triforce.config import SamplingParams, SpecParams
from triforce.decoding.engine import Engine
from triforce.errors import UserError
from triforce.kernels.cpu.linear import dense as cpu_linear

GREEDY = SamplingParams()
PROMPTS = ["the cat sat on the mat. the cat sat on the hat. the cat",
           "abc abc abc abd abc abe abc",
           "one two three four five six seven eight nine ten one two three",
           "hello world, hello there, hello again, hello",
           "to be or not to be, that is the question. to be",
           "red green blue red green blue red green",
           "mary had a little lamb, little lamb, little lamb, mary had"]
TINY = dict(gamma1=3, gamma2=5, budget=24, chunk_size=4, sink_tokens=4, rebuild_stride=8, draft_window=16,
            snapkv_window=4)
FIXED = frozenset({"budget", "chunk_size", "gamma1", "gamma2"})


def tiny_runtime(folder, method: str, draft=None):
    spec = SpecParams(method="ar") if method == "ar" else SpecParams(method=method, **TINY)
    fixed = FIXED if method != "ar" else frozenset()
    return build_runtime(RunConfig(model=str(folder), draft=draft, spec=spec, fixed=fixed, dtype="float32"))


def single_ar(lm, ids: list[int], new: int, stop=frozenset()) -> list[int]:
    engine = Engine(lm, SpecParams(method="ar"), len(ids) + new)
    engine.set_sequence(ids)
    return engine.generate(new, GREEDY, stop).tokens


def batch(runtime, prompts: list[list[int]], new: int, rows: int, stop=frozenset()):
    max_len = max(map(len, prompts)) + new
    _, run = fit_batch(runtime, max_len, len(prompts), rows)
    return generate_batch(runtime, prompts, [new] * len(prompts), GREEDY, stop, rows, run)


@pytest.mark.parametrize("kernels", ["eager", "numba halves"])
@pytest.mark.parametrize("method,drafter", [("ar", None), ("streaming", None), ("snapkv", None),
                                            ("retrieval", None), ("triforce", "lookup"), ("triforce", "model")])
def test_every_row_equals_its_own_ar_run(tiny_model_dir, monkeypatch, method, drafter, kernels):
    if kernels == "numba halves":  # the tiny model's matrices take the small-rows kernels too
        monkeypatch.setattr(cpu_linear, "MIN_WEIGHTS", 1)
    folder = tiny_model_dir("llama-gqa")
    draft = str(tiny_model_dir("llama-gqa", seed=7, num_layers=1, hidden_size=32)) if drafter == "model" else drafter
    runtime = tiny_runtime(folder, method, draft)
    layers = runtime.lm.model.model.layers
    assert all((layer.cpu_layer is not None) == (kernels == "numba halves") for layer in layers)
    prompts = [runtime.lm.tokenizer(text).input_ids for text in PROMPTS]
    outcome = batch(runtime, prompts, 30, rows=3)  # 7 prompts in 3 slots: slots are reused
    assert [r.index for r in outcome.rows] == list(range(len(PROMPTS)))
    for ids, row in zip(prompts, outcome.rows):
        assert row.result.tokens == single_ar(runtime.lm, ids, 30), (method, row.index)
    assert outcome.rows_per_pass > 1.5  # the rows' passes did run together


def test_rows_that_stop_early_leave_the_others_alone(tiny_model_dir):
    runtime = tiny_runtime(tiny_model_dir("llama-gqa"), "snapkv")
    lm = runtime.lm
    prompts = [lm.tokenizer(text).input_ids for text in PROMPTS[:5]]
    plain = [single_ar(lm, ids, 40) for ids in prompts]
    stop = frozenset(set(plain[0]) | set(plain[2])) - set(plain[1]) - set(plain[3]) - set(plain[4])
    outcome = batch(runtime, prompts, 40, rows=2, stop=stop)  # rows 0 and 2 end early
    assert [r.result.stopped_by for r in outcome.rows] == ["eos", "length", "eos", "length", "length"]
    for ids, row in zip(prompts, outcome.rows):
        assert row.result.tokens == single_ar(lm, ids, 40, stop)


def test_the_default_model_in_a_batch_decodes_as_alone(default_model_dir):
    """The model users run, float32, with its numba halves taking the batch's rows together."""
    runtime = build_runtime(RunConfig(model=str(default_model_dir), spec=SpecParams(method="snapkv"),
                                      dtype="float32"))
    tok = runtime.lm.tokenizer
    texts = ["The history of the printing press begins", "def fibonacci(n):\n    ", "Water boils at",
             "The three primary colours are"]
    prompts = [tok(t).input_ids for t in texts]
    outcome = batch(runtime, prompts, 24, rows=4)
    for ids, row in zip(prompts, outcome.rows):
        assert row.result.tokens == single_ar(runtime.lm, ids, 24)


def test_the_plan_splits_the_device_between_rows(tiny_model_dir):
    runtime = build_runtime(RunConfig(model=str(tiny_model_dir("llama-gqa")), spec=SpecParams(method="ar"),
                                      dtype="float32", device_budget="40MB"))
    one = row_plan(runtime, 4096, 1).plan
    weights = one.breakdown["target_weights"]
    rows, run = fit_batch(runtime, 4096, 64, None)
    assert 1 < rows < 64  # 64 rows of 4096 tokens do not fit 40 MB, a few do
    assert weights + rows * (run.plan.gpu_bytes_total - weights) <= one.gpu_budget_bytes
    with pytest.raises(UserError, match="does not fit"):
        row_plan(runtime, 4096, rows + 1)
    with pytest.raises(UserError, match="a batch of 64 rows does not fit"):
        fit_batch(runtime, 4096, 64, 64)


def test_prompt_lines_are_checked():
    assert parse_prompt_lines('{"prompt": "a"}\n\n{"prompt": "b", "x": 1}\n', "f") == ["a", "b"]
    for text, message in [("", "holds no prompts"), ('{"prompt": "a"}\nnot json', "line 2 is not JSON"),
                          ('{"text": "a"}', 'line 1 has no "prompt" string'), ('["a"]', "line 1 has no"),
                          ('{"prompt": 3}', "line 1 has no")]:
        with pytest.raises(UserError, match=message):
            parse_prompt_lines(text, "f")
    assert json.loads('{"prompt": "\\ud800"}')  # a lone surrogate parses, but is not text:
    with pytest.raises(UserError, match="not valid Unicode"):
        parse_prompt_lines('{"prompt": "\\ud800"}', "f")


def test_the_default_batch_size_is_bounded_however_many_prompts_come(tiny_model_dir, monkeypatch):
    """3,000 short prompts once asked for 2,239 rows (40 GiB of host memory, refused after the
    plan): the default stops at MAX_AUTO_ROWS, and below it at what the host has room for."""
    from triforce.app import batch_generate
    from triforce.model import host_memory

    runtime = build_runtime(RunConfig(model=str(tiny_model_dir("llama-gqa")), spec=SpecParams(method="ar"),
                                      dtype="float32"))
    assert fit_batch(runtime, 64, 3000, None)[0] == batch_generate.MAX_AUTO_ROWS
    plan = row_plan(runtime, 64, 5).plan  # a row's buffers on this CPU (its weights are shared)
    per_row = plan.host_bytes_total + plan.gpu_bytes_total - plan.breakdown["target_weights"]
    monkeypatch.setattr(host_memory, "available_bytes", lambda: 5 * per_row + per_row // 2)
    assert fit_batch(runtime, 64, 3000, None)[0] == 5
