"""`seed` through the openai client: the same sampled request with the same seed gives the same
answer, alone or beside another request in the batch; other seeds give other answers."""
import threading

import pytest

from serve_helpers import LiveServer

ASK = [{"role": "user", "content": "Write one sentence about a lighthouse."}]


@pytest.fixture(scope="module")
def server(default_model_dir):
    live = LiveServer(str(default_model_dir), max_context=512, batch_size=2)
    yield live
    live.stop()


def _answer(client, seed):
    reply = client.chat.completions.create(model="default", messages=ASK, temperature=1.0, max_tokens=16, seed=seed)
    return reply.choices[0].message.content


def test_a_seed_gives_the_same_answer_again_and_beside_another_request(server):
    client = server.client()
    first = _answer(client, 1234)
    assert _answer(client, 1234) == first
    beside = {}
    with server.held():  # both start together: rows of one batch
        threads = [threading.Thread(target=lambda s=s: beside.__setitem__(s, _answer(client, s))) for s in (1234, 99)]
        for t in threads:
            t.start()
        from serve_helpers import wait_for
        wait_for(lambda: server.scheduler.queued == 2, "both requests to queue")
    for t in threads:
        t.join()
    assert beside[1234] == first
    assert len({first, beside[99], _answer(client, 5), _answer(client, 6)}) > 1
