"""`triforce serve` on a simulated card (`--device cuda`), as serve assembles it: rows decode on
the serving thread, a request alone takes the lone engine over its row's full cache (its tiers
counted against the card's budget beside the batch's rows), and the answers are a one-row
server's, greedy, with every tensor placed as CUDA would want it."""
import pytest
import httpx

from device_discipline import DeviceDiscipline
from triforce.config import RunConfig, SpecParams
from triforce.server.assembly import build_api
from triforce.server.background import serve_while

CONTEXT = 8192  # where auto gives the card's lone row triforce: a retrieval tier beside the batch's rows
PROMPT = "the cat sat on the mat. the dog sat on the log. the cat"


@pytest.fixture(scope="module")
def folder(tiny_model_dir):
    return str(tiny_model_dir("llama-gqa", max_position_embeddings=CONTEXT))


def _answers(card, folder, rows: int, device: str) -> tuple[list[str], dict]:
    config = RunConfig(model=folder, device=device, max_context=CONTEXT, spec=SpecParams(method="auto"))

    def ask(url: str) -> list[str]:
        body = {"prompt": PROMPT, "max_tokens": 40, "temperature": 0, "ignore_eos": True}
        texts = [httpx.post(url + "/v1/completions", json=body, timeout=300).json()["choices"][0]["text"]
                 for _ in range(2)]
        return texts + [httpx.get(url + "/health").json()]

    with card.placement(), DeviceDiscipline() as mode:
        api, _ = build_api(config, batch_size=rows, quiet=True)
        checked = mode.checked
        *texts, health = serve_while(api, ask)
    assert mode.checked > checked  # the rows' factories and draws were seen: they ran on this thread
    return texts, health


def test_a_lone_request_on_the_card_answers_as_one_row(card, folder):
    alone, health = _answers(card, folder, 2, "cuda")
    assert health["method_alone"] == "triforce" and health["decoded_alone"] == 2
    one_row, single = _answers(card, folder, 1, "cuda:0")
    assert single["method_alone"] is None and alone == one_row and alone[0] == alone[1]
