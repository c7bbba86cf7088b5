"""A request that runs alone on a server planned for several rows decodes as `generate` would
(auto's single-run choice, its lookup probe included) over its row's cache; beside another request
it takes the batch's method. Both ways share one full cache, so a conversation whose turns
alternate between them reuses its prefix and answers as a one-row server does."""
import json
import threading
import urllib.request

import pytest

from serve_helpers import LiveServer, wait_for

CONTEXT = 8192  # where auto gives the tiny model's batch triforce and a lone row ar, trying naive
OPENING = "the cat sat on the mat. the dog sat on the log. the cat"


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return str(tiny_model_dir("llama-gqa", max_position_embeddings=CONTEXT))


def _complete(client, prompt: str) -> str:
    return client.completions.create(model="default", prompt=prompt, temperature=0, max_tokens=48).choices[0].text


def _health(server) -> dict:
    with urllib.request.urlopen(server.url + "/health") as reply:
        return json.loads(reply.read())


def _beside_another(server, client, prompt: str) -> str:
    """prompt's answer decoded as a row of the batch, next to another request."""
    answers = {}
    with server.held():
        threads = [threading.Thread(target=lambda p=p: answers.__setitem__(p, _complete(client, p)))
                   for p in (prompt, "a bird sang in a tree")]
        for t in threads:
            t.start()
        wait_for(lambda: server.scheduler.queued == 2, "both requests to queue")
    for t in threads:
        t.join()
    return answers[prompt]


def test_a_conversation_alone_then_in_a_batch_then_alone_answers_as_one_row_would(model):
    single = LiveServer(model, max_context=CONTEXT, batch_size=1)
    try:
        assert single.scheduler.lone_run is None  # one row plans as generate already
        client = single.client()
        turns, expected = [OPENING], []
        for more in (" and the dog", " then the bird"):
            expected.append(_complete(client, turns[-1]))
            turns.append(turns[-1] + expected[-1] + more)
        expected.append(_complete(client, turns[-1]))
    finally:
        single.stop()

    server = LiveServer(model, max_context=CONTEXT, batch_size=2)
    try:
        health = _health(server)
        assert health["method"] == "triforce" and health["method_alone"] == "naive"
        client = server.client()
        assert _complete(client, turns[0]) == expected[0]
        assert _health(server)["decoded_alone"] == 1
        assert _beside_another(server, client, turns[1]) == expected[1]
        assert _health(server)["decoded_alone"] == 1  # both rows took the batch's triforce
        assert _complete(client, turns[2]) == expected[2]
        assert _health(server)["decoded_alone"] == 2
        # each turn reused the cache of the turn before, answer included, which the other engine filled
        reused = {entry[1]: entry[2] for entry in server.scheduler.recent}
        assert reused[len(turns[1])] >= len(turns[0]) + 40 and reused[len(turns[2])] >= len(turns[1]) + 40
    finally:
        server.stop()


def test_a_method_the_user_names_serves_every_row(model):
    server = LiveServer(model, max_context=CONTEXT, batch_size=2, method="retrieval")
    try:
        assert server.scheduler.lone_run is None and _health(server)["method_alone"] is None
        client = server.client()
        _complete(client, OPENING)
        assert _health(server)["decoded_alone"] == 0
    finally:
        server.stop()
