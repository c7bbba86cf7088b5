"""triforce from Python: the README's example runs exactly as printed, and the API's paths are the
CLI's: greedy tokens equal `triforce generate`'s, a batch equals its rows run alone, a stream
joins to the whole text, a conversation keeps its KV between turns, and bad values raise the
CLI's one-line messages as UserError and ValueError. `import triforce` loads no torch."""
import re
from pathlib import Path

import pytest

from cli_json import run_json, run_python

README = Path(__file__).resolve().parents[2] / "README.md"
PROMPT = "The capital of France is"


def test_the_readme_example_runs_as_printed(capsys):
    section = README.read_text().split("## Python", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    exec(compile(code, "README.md (Python)", "exec"), {})
    out = capsys.readouterr().out
    assert "Paris" in out and re.search(r" (length|stop) [0-9.]+\n", out)  # text, finish reason, tokens/s
    assert len([line for line in out.splitlines() if line.strip()]) >= 6


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    from triforce import LLM

    folder = tiny_model_dir("llama-gqa", max_position_embeddings=512)
    return LLM(str(folder), method="triforce", draft="lookup", dtype="float32", device="cpu"), folder


def test_greedy_tokens_equal_triforce_generate(llm, capsys):
    from triforce import SamplingParams

    model, folder = llm
    seen = []
    result = model.generate(PROMPT, SamplingParams(max_tokens=20, ignore_eos=True), on_prefill=lambda *n: seen.append(n))
    cli = run_json(capsys, "generate", "--model", folder, "--prompt", PROMPT, "--max-new-tokens", 20, "--ignore-eos",
                   "--method", "triforce", "--draft", "lookup", "--dtype", "float32", "--device", "cpu", "--json")
    assert result.token_ids == cli["tokens"] and result.text == cli["text"] and result.finish_reason == "length"
    assert result.stats["method"] == "triforce" and result.stats["plan"] == cli["plan"]
    assert seen and seen[-1] == (cli["prompt_tokens"] - 1,) * 2  # the prefill's progress, to its end
    assert capsys.readouterr().out == ""  # the library printed nothing


def test_a_batch_a_stream_and_ids_give_the_single_runs_tokens(llm):
    from triforce import SamplingParams

    model, _ = llm
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    prompts = [PROMPT, "Once upon a time", "one two three"]
    alone = [model.generate(p, params) for p in prompts]
    batch = model.generate(prompts, params)
    assert [r.token_ids for r in batch] == [r.token_ids for r in alone] and batch[0].stats["batch_size"] >= 1
    assert "".join(model.stream(PROMPT, params)) == alone[0].text
    assert model.generate(model.encode(PROMPT), params).token_ids == alone[0].token_ids


def test_a_stream_decodes_on_the_callers_thread_and_stops_when_closed(llm, monkeypatch):
    """(on another thread OpenMP's workers sleep between kernels: half the speed on a CPU)"""
    import threading

    from triforce import SamplingParams
    from triforce.decoding.engine import Engine

    model, _ = llm
    rounds, threads = [], set()
    generate = Engine.generate

    def spied(self, *args, **kwargs):
        threads.add(threading.get_ident())
        return generate(self, *args, **kwargs)

    monkeypatch.setattr(Engine, "generate", spied)
    monkeypatch.setattr(Engine, "_round", lambda self, *a, _round=Engine._round: rounds.append(1) or _round(self, *a))
    params = SamplingParams(max_tokens=200, ignore_eos=True)
    pieces = model.stream(PROMPT, params)
    first = next(pieces)
    pieces.close()
    assert first and threads == {threading.get_ident()}
    assert 0 < len(rounds) < 100  # closed after the first piece, decoding stopped at its next round

    def broken(self, *args, **kwargs):
        raise RuntimeError("the engine broke")

    monkeypatch.setattr(Engine, "generate", broken)
    with pytest.raises(RuntimeError, match="the engine broke"):  # an error while decoding reaches the caller
        next(model.stream(PROMPT, params))


def test_a_stop_string_ends_the_answer(llm):
    from triforce import SamplingParams

    model, _ = llm
    whole = model.generate(PROMPT, SamplingParams(max_tokens=24, ignore_eos=True))
    stop = whole.text[len(whole.text) // 2:][:2]
    cut = model.generate(PROMPT, SamplingParams(max_tokens=24, ignore_eos=True, stop=[stop]))
    assert cut.finish_reason == "stop" and cut.text == whole.text[:whole.text.find(stop)]
    assert len(cut.token_ids) < len(whole.token_ids)  # decoding stopped, not only the text


def test_a_conversation_keeps_its_kv_between_turns(llm):
    from triforce import SamplingParams

    model, _ = llm
    conversation = model.conversation(system="Be brief.")
    first = conversation.send("Hello there", SamplingParams(max_tokens=6))
    second = conversation.send("And again", SamplingParams(max_tokens=6))
    context = second.stats["context_tokens"]
    assert 0 < second.stats["prefilled_tokens"] < context - len(first.token_ids)  # only the new turn
    assert [m["role"] for m in conversation.messages] == ["system", "user", "assistant", "user", "assistant"]
    whole = model.chat(conversation.messages[:-1], SamplingParams(max_tokens=6))
    assert whole.token_ids == second.token_ids  # the kept KV answers as the whole conversation does


@pytest.mark.parametrize("make, message", [
    (lambda t: t.SamplingParams(temperature=-1), "temperature must be >= 0, got -1"),
    (lambda t: t.SamplingParams(top_p=0), "top-p must be in (0, 1], got 0"),
    (lambda t: t.SamplingParams(max_tokens=-1), "max_tokens must be an integer >= 0, got -1"),
    (lambda t: t.SamplingParams(stop=[3]), "stop must be a string or a list of strings"),
    (lambda t: t.SamplingParams(seed=2**64), f"seed must be an integer from {-2**63} to {2**64 - 1}"),
    (lambda t: t.SamplingParams(seed=-2**63 - 1), "seed must be an integer"),
    (lambda t: t.SamplingParams(seed=1.5), "seed must be an integer"),
    (lambda t: t.SamplingParams(seed=True), "seed must be an integer"),
])
def test_bad_values_raise_the_clis_one_line_messages(make, message):
    import triforce

    with pytest.raises(triforce.UserError, match=re.escape(message)) as error:
        make(triforce)
    assert isinstance(error.value, ValueError) and "\n" not in str(error.value)


def test_bad_prompts_and_messages_are_user_errors(llm):
    import triforce

    model, _ = llm
    with pytest.raises(triforce.UserError, match="the prompt has .* tokens but the model's context is 512 tokens"):
        model.generate("word " * 600)
    with pytest.raises(triforce.UserError, match="messages must be a non-empty list"):
        model.chat([{"role": "robot", "content": "hi"}])
    with pytest.raises(ValueError, match="token ids must be integers"):
        model.generate([1, -5])


def test_import_triforce_loads_no_torch():
    code = ("import sys, triforce; assert 'torch' not in sys.modules; "
            "assert sorted(triforce.__all__) == sorted(['LLM', 'SamplingParams', 'Result', 'CompletionOutput', 'Conversation', 'UserError', "
            "'BadValue', '__version__']); from triforce import SamplingParams; SamplingParams(max_tokens=3); "
            "assert 'torch' not in sys.modules")
    run_python(code)


@pytest.mark.parametrize("kwargs, message", [
    ({"method": "bogus"}, "unknown method 'bogus'"),
    ({"device": "tpu"}, "unknown device 'tpu'"),
    ({"model": "/nonexistent"}, "model path '/nonexistent' does not exist"),
    ({"gamma2": 0}, "--gamma2 must be >= 1, got 0"),
])
def test_bad_llm_arguments_are_one_line_user_errors(kwargs, message):
    import triforce

    with pytest.raises(triforce.UserError, match=re.escape(message)):
        triforce.LLM(**kwargs)
