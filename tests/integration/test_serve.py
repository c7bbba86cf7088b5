"""`triforce serve` through the official openai client on the loopback: streamed text equals
the whole answer and `generate --chat`, stop strings, concurrent requests decoded together,
the next turn of a conversation reusing the cached KV, and a client that leaves stopping its row."""
import json
import socket
import threading

import httpx
import pytest

from serve_helpers import LiveServer, wait_for
from test_cli import run_cli

QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def server(default_model_dir):
    live = LiveServer(str(default_model_dir), max_context=2048, batch_size=3)
    yield live
    live.stop()


# greedy as `generate --temperature 0` decodes: a request that leaves the penalty out gets the
# model's default, which for the default model (it sets none) is chat's 1.1
PLAIN = {"repeat_penalty": 1.0}


def chat(client, content, stream=False, **kw):
    messages = content if isinstance(content, list) else [{"role": "user", "content": content}]
    kw.setdefault("temperature", 0)
    kw.setdefault("extra_body", PLAIN)
    if not stream:
        return client.chat.completions.create(model="any", messages=messages, **kw)
    chunks = list(client.chat.completions.create(model="any", messages=messages, stream=True, **kw))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    return text, finish, chunks


def generate_chat(capsys, model_dir, prompt, max_new):
    code, out, _ = run_cli(capsys, "generate", "--model", str(model_dir), "--chat", "--prompt", prompt,
                           "--temperature", "0", "--max-new-tokens", str(max_new), "--dtype", "float32", "--json")
    assert code == 0
    return json.loads(out)


def test_models_and_health(server):
    models = server.client().models.list().data
    assert [m.id for m in models] == ["smollm2-135m-instruct"]
    health = httpx.get(server.url + "/health").json()
    assert health["status"] == "ok" and health["batch_size"] == 3


def test_streamed_and_whole_answers_equal_generate_chat(server, capsys, default_model_dir):
    client = server.client()
    whole = chat(client, QUESTION, max_tokens=24)
    text, finish, chunks = chat(client, QUESTION, stream=True, max_tokens=24,
                                stream_options={"include_usage": True})
    expected = generate_chat(capsys, default_model_dir, QUESTION, 24)
    assert whole.choices[0].message.content == text == expected["text"]
    assert "Paris" in text
    assert whole.choices[0].message.role == "assistant" and chunks[0].choices[0].delta.role == "assistant"
    assert whole.choices[0].finish_reason == finish[0] == ("stop" if expected["stopped_by"] == "eos" else "length")
    usage = chunks[-1].usage  # include_usage: a last chunk with no choices and the usage
    assert chunks[-1].choices == [] and usage.completion_tokens == whole.usage.completion_tokens
    assert usage.prompt_tokens == whole.usage.prompt_tokens == expected["prompt_tokens"]
    assert usage.completion_tokens == len(expected["tokens"])
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_length_finish_and_completions_equal_generate(server, capsys, default_model_dir):
    client = server.client()
    short = chat(client, QUESTION, max_completion_tokens=3)
    assert short.choices[0].finish_reason == "length" and short.usage.completion_tokens == 3
    prompt = "The three primary colours are"
    whole = client.completions.create(model="any", prompt=prompt, max_tokens=12, temperature=0, extra_body=PLAIN)
    parts = list(client.completions.create(model="any", prompt=prompt, max_tokens=12, temperature=0, stream=True,
                                           extra_body=PLAIN))
    code, out, _ = run_cli(capsys, "generate", "--model", str(default_model_dir), "--prompt", prompt,
                           "--temperature", "0", "--max-new-tokens", "12", "--dtype", "float32", "--json")
    expected = json.loads(out)
    assert whole.choices[0].text == "".join(p.choices[0].text for p in parts) == expected["text"]
    assert whole.usage.prompt_tokens == expected["prompt_tokens"]


def test_stop_strings_end_the_answer_before_them(server):
    client = server.client()
    full = chat(client, QUESTION, max_tokens=24).choices[0].message.content
    cut = full.index("France") + 2  # "Fr|ance": the stop string starts inside a token
    stops = ["ance", "never in the answer"]
    whole = chat(client, QUESTION, max_tokens=24, stop=stops)
    text, finish, _ = chat(client, QUESTION, stream=True, max_tokens=24, stop=stops)
    assert whole.choices[0].message.content == text == full[:cut]
    assert whole.choices[0].finish_reason == finish[0] == "stop"


def test_seeded_sampling_repeats(server):
    client = server.client()
    a = chat(client, QUESTION, temperature=1.0, seed=7, max_tokens=12).choices[0].message.content
    b = chat(client, QUESTION, temperature=1.0, seed=7, max_tokens=12, stream=True)[0]
    assert a == b


def test_concurrent_requests_decode_together_with_their_own_answers(server):
    questions = ["Name a colour.", "What is 2 + 2?", "Say hello in French."]
    client = server.client()
    alone = [chat(client, q, max_tokens=16).choices[0].message.content for q in questions]
    server.idle()
    before = server.scheduler.lockstep.passes, server.scheduler.lockstep.rows_per_pass
    answers = [None] * 3
    with server.held():
        threads = [threading.Thread(target=lambda i=i: answers.__setitem__(
            i, chat(client, questions[i], max_tokens=16).choices[0].message.content)) for i in range(3)]
        for t in threads:
            t.start()
        wait_for(lambda: server.scheduler.queued == 3, "three queued requests")
    for t in threads:
        t.join()
    assert answers == alone
    passes = server.scheduler.lockstep.passes - before[0]
    rows = server.scheduler.lockstep.rows_per_pass - before[1]
    assert rows / passes > 1.5  # the three shared their decoding steps


def test_next_turn_reuses_the_cached_prefix(server):
    """Two conversations over long documents, answered in the order A1 B1 B2 A2: each second turn
    finds its own first turn's cache, although the other conversation ran in between."""
    client = server.client()

    def first_turn(topic):
        document = " ".join(f"Line {i}: the {topic} lists item {i * 7} under shelf {i % 13}." for i in range(90))
        turn = [{"role": "user", "content": f"Here is a document:\n{document}\n\nWhat does line 3 list?"}]
        answer = chat(client, turn, max_tokens=12)
        assert answer.usage.prompt_tokens > 1000
        return turn + [{"role": "assistant", "content": answer.choices[0].message.content}], answer

    a, a1 = first_turn("archive")
    b, b1 = first_turn("warehouse")
    for history, first in ((b, b1), (a, a1)):
        turn2 = history + [{"role": "user", "content": "And line 5?"}]
        second = chat(client, turn2, max_tokens=12)
        # the whole first turn's prompt came from the cache
        assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 1
    # the last answer is a cold start's: a fresh engine decoding the whole conversation
    from triforce.app.chat import render_messages
    from triforce.config import SamplingParams
    lm = server.api.lm
    engine = server.scheduler.runtime.engine(2048)
    engine.set_sequence(render_messages(lm.tokenizer, turn2, True, 2048))
    cold = engine.generate(12, SamplingParams(), lm.eos_ids)
    assert second.choices[0].message.content == lm.tokenizer.decode(cold.tokens, skip_special_tokens=True)


def _raw_post(server, body: dict) -> socket.socket:
    host, port = server.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    data = json.dumps(body).encode()
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_leaves_stops_its_generation(server, stream):
    body = {"messages": [{"role": "user", "content": "Write a very long story about a dragon."}],
            "max_tokens": 1900, "ignore_eos": True, "stream": stream}
    server.idle()
    served = server.scheduler.served
    sock = _raw_post(server, body)
    wait_for(lambda: server.scheduler.running == 1, "the request to start")
    if stream:  # the headers may come in a packet of their own
        received = b""
        while b"data:" not in received:
            piece = sock.recv(65536)
            assert piece, f"the stream closed before any event: {received!r}"
            received += piece
    sock.close()
    wait_for(lambda: server.scheduler.served == served + 1 and server.scheduler.running == 0, "the row to stop")
    label, prompt, _, tokens, stopped_by = server.scheduler.recent[-1]
    assert stopped_by == "interrupt" and tokens < 1900


def test_a_client_that_leaves_while_queued_is_never_decoded(server, monkeypatch):
    jobs = []
    submit = server.scheduler.submit
    monkeypatch.setattr(server.scheduler, "submit", lambda job: (jobs.append(job), submit(job)))
    server.idle()
    served, assigned = server.scheduler.served, server.scheduler._clock
    with server.held():
        sock = _raw_post(server, {"messages": [{"role": "user", "content": "Hello?"}], "max_tokens": 50})
        wait_for(lambda: jobs, "the request to queue")
        sock.close()
        wait_for(lambda: jobs[0].stop, "the server to see the client leave")
    wait_for(lambda: server.scheduler.served == served + 1, "the queued request to be dropped")
    assert server.scheduler.recent[-1][3:] == (0, "interrupt") and jobs[0].tokens == 0
    assert server.scheduler._clock == assigned  # no engine was given to it: nothing prefilled


def test_penalties_are_taken_and_equal_generate_with_the_same_flags(server, capsys, default_model_dir):
    """OpenAI's presence and frequency penalties and llama.cpp's repeat_penalty, as a chat front
    end sends them: the answer is `generate`'s with the same flags (greedy, so exact)."""
    client = server.client()
    prompt = "List the days of the week, then list them again:"
    penalties = dict(presence_penalty=0.6, frequency_penalty=0.4)
    whole = client.completions.create(model="any", prompt=prompt, max_tokens=16, temperature=0,
                                      extra_body={"repeat_penalty": 1.3, "repeat_last_n": 32}, **penalties)
    code, out, _ = run_cli(capsys, "generate", "--model", str(default_model_dir), "--prompt", prompt,
                           "--temperature", "0", "--max-new-tokens", "16", "--dtype", "float32", "--json",
                           "--presence-penalty", "0.6", "--frequency-penalty", "0.4", "--repeat-penalty", "1.3",
                           "--penalty-last-n", "32")
    assert code == 0 and whole.choices[0].text == json.loads(out)["text"]
    plain = client.completions.create(model="any", prompt=prompt, max_tokens=16, temperature=0)
    assert plain.choices[0].text != whole.choices[0].text  # the penalties changed the answer
