"""`triforce serve`'s errors in OpenAI's shape, as the openai client meets them: bad parameters
(named), a prompt longer than the context, a wrong key, a full queue."""
import threading

import httpx
import openai
import pytest

from serve_helpers import LiveServer, wait_for

HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(default_model_dir):
    live = LiveServer(str(default_model_dir), max_context=256, batch_size=1, queue_size=1, api_key="sesame",
                      origins=("http://localhost:3000",))
    yield live
    live.stop()


def error_of(call):
    with pytest.raises(openai.APIStatusError) as caught:
        call()
    e = caught.value
    error = e.response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return e.status_code, error


@pytest.mark.parametrize("kw,param,fragment", [
    ({"temperature": 3}, "temperature", "less than or equal to 2"),
    ({"top_p": 0}, "top_p", "greater than 0"),
    ({"n": 9}, "n", "n must be between 1 and 8"),
    ({"max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
    ({"max_completion_tokens": -5}, "max_completion_tokens", "greater than or equal to 1"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4"),
    ({"presence_penalty": 2.5}, "presence_penalty", "less than or equal to 2"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "between 0 and 20"),
    ({"top_logprobs": 2}, "top_logprobs", "needs logprobs: true"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", "not supported"),
    ({"stream_options": {"include_usage": True}}, "stream_options", "needs stream"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role", "Input should be"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content", ""),
    ({"messages": []}, "messages", "at least 1"),
])
def test_bad_parameters_are_400_with_the_parameter_named(server, kw, param, fragment):
    client = server.client(api_key="sesame")
    kw = {"messages": HI, **kw}
    status, error = error_of(lambda: client.chat.completions.create(model="m", **kw))
    assert status == 400 and error["param"] == param and fragment in error["message"]
    assert error["type"] == "invalid_request_error"


def test_a_prompt_longer_than_the_context_is_400(server):
    client = server.client(api_key="sesame")
    long = "word " * 400
    status, error = error_of(lambda: client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": long}]))
    assert status == 400 and error["code"] == "context_length_exceeded" and "256" in error["message"]
    status, error = error_of(lambda: client.completions.create(model="m", prompt=long))
    assert status == 400 and error["param"] == "prompt" and error["code"] == "context_length_exceeded"


def test_completions_parameters(server):
    client = server.client(api_key="sesame")
    status, error = error_of(lambda: client.completions.create(model="m", prompt="a", echo=True))
    assert status == 400 and error["param"] == "echo"
    status, error = error_of(lambda: client.completions.create(model="m", prompt=[99999999]))
    assert status == 400 and error["param"] == "prompt"
    status, error = error_of(lambda: client.completions.create(model="m", prompt="a", logprobs=6))
    assert status == 400 and error["param"] == "logprobs" and "between 0 and 5" in error["message"]
    out = client.completions.create(model="m", prompt="The sky is", max_tokens=2, temperature=0)
    assert out.usage.completion_tokens == 2 and out.choices[0].finish_reason == "length"


def test_a_wrong_or_missing_key_is_401_and_health_needs_none(server):
    for key in ("wrong", "none"):
        status, error = error_of(lambda: server.client(api_key=key).models.list())
        assert status == 401 and error["code"] == "invalid_api_key"
    assert [m.id for m in server.client(api_key="sesame").models.list().data]
    assert httpx.get(server.url + "/health").json()["status"] == "ok"


def test_raw_http_errors_keep_the_shape(server):
    headers = {"Authorization": "Bearer sesame"}
    bad_json = httpx.post(server.url + "/v1/chat/completions", content=b"{oops",
                          headers={**headers, "Content-Type": "application/json"})
    assert bad_json.status_code == 400 and "not valid JSON" in bad_json.json()["error"]["message"]
    not_object = httpx.post(server.url + "/v1/chat/completions", json=[1, 2], headers=headers)
    assert not_object.status_code == 400 and "JSON object" in not_object.json()["error"]["message"]
    missing = httpx.get(server.url + "/v1/nothing", headers=headers)
    assert missing.status_code == 404 and missing.json()["error"]["message"] == "Not Found"


def test_a_full_queue_answers_503(server):
    client = server.client(api_key="sesame")
    answers = []
    with server.held():  # one row, a queue of one: the first request holds the queue
        first = threading.Thread(target=lambda: answers.append(
            client.chat.completions.create(model="m", messages=HI, max_tokens=2, temperature=0)))
        first.start()
        wait_for(lambda: server.scheduler.queued == 1, "the first request to queue")
        status, error = error_of(lambda: client.chat.completions.create(model="m", messages=HI, max_tokens=2))
    first.join()
    assert status == 503 and error["code"] == "queue_full"
    assert answers and answers[0].usage.completion_tokens >= 1  # the queued one was answered


def test_only_allowed_web_origins_get_cors_headers(server):
    def preflight(origin):
        return httpx.options(server.url + "/v1/chat/completions", headers={
            "Origin": origin, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type"})
    allowed = preflight("http://localhost:3000")
    assert allowed.status_code == 200
    assert allowed.headers["access-control-allow-origin"] == "http://localhost:3000"
    assert "access-control-allow-origin" not in preflight("http://evil.example").headers
