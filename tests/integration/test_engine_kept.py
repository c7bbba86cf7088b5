"""Issue 73: triforce.LLM keeps its engine between requests (Runtime.kept_engine): the caches,
the drafting tiers' graphs and the KV of a prompt seen before carry over, so a second request
builds nothing and prefills only what is new, and answers as a fresh engine would."""
import pytest

PROMPT = "the cat sat on the mat. the cat sat on the hat. the cat and the dog sat on the log."


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    from triforce import LLM

    folder = str(tiny_model_dir("llama-gqa", max_position_embeddings=4096))
    return LLM(folder, method="triforce", draft="lookup", dtype="float32", device="cpu")


def ask(llm, prompt, **fields):
    from triforce import SamplingParams

    return llm.generate(prompt, SamplingParams(max_tokens=fields.pop("max_tokens", 8), ignore_eos=True, **fields))


def test_a_second_request_keeps_the_engine_and_the_prompt_s_kv(llm):
    first = ask(llm, PROMPT)
    again = ask(llm, PROMPT)
    assert again.stats["engine_reused"] and again.stats["cached_tokens"] == len(llm.encode(PROMPT)) - 1
    assert again.token_ids == first.token_ids
    roomier = ask(llm, PROMPT, max_tokens=16)  # past the first engine's room: the next has room to spare
    assert not roomier.stats["engine_reused"] and roomier.stats["plan"]["context"] == 1024
    longer = PROMPT + " the dog ran"
    extended = ask(llm, longer)
    assert extended.stats["engine_reused"]
    assert len(llm.encode(PROMPT)) - 1 <= extended.stats["cached_tokens"] < len(llm.encode(longer)) - 1
    assert ask(llm, "a different start").stats["cached_tokens"] == 0


def test_answers_from_a_kept_engine_equal_a_fresh_one(llm, tiny_model_dir):
    from triforce import LLM

    sampled = dict(temperature=0.8, top_p=0.95, seed=11)
    kept = [ask(llm, PROMPT, **sampled).token_ids for _ in range(2)]
    fresh = LLM(str(tiny_model_dir("llama-gqa", max_position_embeddings=4096)), method="triforce", draft="lookup",
                dtype="float32", device="cpu")
    assert kept == [ask(fresh, PROMPT, **sampled).token_ids] * 2


def test_a_request_beyond_the_kept_engine_s_room_builds_another(llm):
    ask(llm, PROMPT, max_tokens=4)
    bigger = ask(llm, PROMPT, max_tokens=1100)  # past the kept engine's 1024 tokens
    assert not bigger.stats["engine_reused"]
    assert ask(llm, PROMPT, max_tokens=4).stats["engine_reused"]  # the bigger one serves smaller requests


def test_a_failed_request_leaves_no_engine_behind(llm, monkeypatch):
    from triforce.decoding.engine import Engine

    ask(llm, PROMPT)
    generate = Engine.generate

    def fails(self, *args, **kwargs):
        monkeypatch.setattr(Engine, "generate", generate)
        raise RuntimeError("the device went away")

    monkeypatch.setattr(Engine, "generate", fails)
    with pytest.raises(RuntimeError, match="went away"):
        ask(llm, PROMPT)
    after = ask(llm, PROMPT)
    assert not after.stats["engine_reused"] and after.stats["cached_tokens"] == 0
