"""The server's pieces that need no model: stop strings over streamed text, and the naming of a
bad parameter in OpenAI's error shape."""
import pytest

from triforce.server.protocol import ApiError, ChatRequest, CompletionRequest, parse
from triforce.app.stop_text import StopText


def stream(pieces, stops):
    stop = StopText(stops)
    sent = [stop.feed(p) for p in pieces]
    return sent, stop


@pytest.mark.parametrize("pieces,stops,text", [
    (["Hello", " wor", "ld. Bye"], ["world"], "Hello "),
    (["ab", "c", "d"], ["cd"], "ab"),
    (["x<", "|e", "nd|>y"], ["<|end|>"], "x"),
    (["aaab"], ["aab", "b"], "a"),  # the earliest stop wins
    (["no", " stop", " here"], ["zz"], "no stop here"),
    (["tail <"], ["<|end|>"], "tail "),  # held back until the answer ends
])
def test_text_ends_before_the_first_stop_string(pieces, stops, text):
    sent, stop = stream(pieces, stops)
    assert "".join(sent) + ("" if stop.matched else stop.flush()) == (text if stop.matched else "".join(pieces))
    if stop.matched:
        assert "".join(sent) == text


def test_nothing_that_could_start_a_stop_is_sent_early():
    sent, stop = stream(["Fine <", "|", "e"], ["<|end|>"])
    assert sent == ["Fine ", "", ""] and stop.held == "<|e"
    assert stop.feed("xit") == "<|exit" and stop.held == ""
    assert stop.feed(" <|end|> more") == " " and stop.matched and stop.feed("later") == ""


@pytest.mark.parametrize("body,param", [
    ({"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, "temperature"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "robot", "content": "y"}]}, "messages[1].role"),
    ({"messages": [{"role": "user", "content": "x"}], "stream_options": {"include_usage": "maybe"}, "stream": True},
     "stream_options.include_usage"),
    ({}, "messages"),
])
def test_a_bad_parameter_is_named(body, param):
    with pytest.raises(ApiError) as caught:
        parse(ChatRequest, body)
    assert caught.value.status == 400 and caught.value.param == param
    assert caught.value.body()["error"]["param"] == param


def test_defaults_follow_openai():
    chat = parse(ChatRequest, {"messages": [{"role": "developer", "content": [{"type": "text", "text": "a"},
                                                                                {"type": "text", "text": "b"}]}],
                               "max_tokens": 5, "max_completion_tokens": 7, "unknown_field": 1})
    assert chat.wanted_tokens() == 7 and chat.messages[0].as_template_message() == {"role": "system", "content": "ab"}
    assert parse(ChatRequest, {"messages": [{"role": "user", "content": "x"}]}).wanted_tokens() is None
    assert parse(CompletionRequest, {"prompt": "x"}).wanted_tokens() == 16
    with pytest.raises(ApiError, match="one string"):
        parse(CompletionRequest, {"prompt": ["a", "b"]})
    with pytest.raises(ApiError, match="prompt is empty"):
        parse(CompletionRequest, {"prompt": []})


def test_nulls_mean_the_defaults():
    body = parse(ChatRequest, {"messages": [{"role": "user", "content": "x"}], "n": None, "stream": None,
                               "temperature": None, "stop": None, "ignore_eos": None})
    assert body.n is None and not body.stream and body.stop_strings() == [] and not body.ignore_eos
