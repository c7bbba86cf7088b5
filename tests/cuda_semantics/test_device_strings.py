"""`--device` as users type it, on simulated cards, through the entry points: `auto`, `cuda` and
`cuda:0` reach the same device, profile and plan on one card; `cuda:1` there is one error line;
on two cards `cuda:1` plans from card 1's memory. `--device auto` once crashed every default
command on real GPUs (an index-less device reached torch's memory-fraction query), which a
stand-in that accepted anything hid."""
import json
from dataclasses import replace

import pytest
import torch

from fake_card import FakeCard
from triforce.app.runtime import build_runtime
from triforce.config import RunConfig
from triforce.cli.main import main
from triforce.errors import UserError

SAME = ["auto", "cuda", "cuda:0"]


def steady(plan: dict) -> dict:
    """A plan without the host budget, which follows the host's free memory from moment to moment."""
    return {k: v for k, v in plan.items() if k != "host_budget_bytes"}


@pytest.fixture(scope="module")
def folder(tiny_model_dir):
    return str(tiny_model_dir("llama-gqa", max_position_embeddings=1024))


def runtime_on(card, folder, device):
    with card.placement():
        return build_runtime(RunConfig(model=folder, device=device))


def test_every_way_of_naming_the_card_reaches_the_same_plan(card, folder):
    plans = {}
    for device in SAME:
        rt = runtime_on(card, folder, device)
        assert rt.lm.device == torch.device("cuda", 0), device
        assert rt.profile.name == "auto:Simulated 24 GB card" and rt.lm.dtype == torch.bfloat16
        plans[device] = (replace(rt.profile, host_bytes=0), steady(rt.plan(1024).plan.to_json()))
    assert plans["auto"] == plans["cuda"] == plans["cuda:0"]
    assert ("get_per_process_memory_fraction", 0) in card.calls


def test_a_second_card_that_is_not_there_is_one_error(card, folder):
    with pytest.raises(UserError, match=r"--device cuda:1: this machine has 1 CUDA device\(s\), cuda:0 to cuda:0"):
        runtime_on(card, folder, "cuda:1")


def test_the_card_named_is_the_card_read(monkeypatch, folder):
    card = FakeCard(count=2).install(monkeypatch)
    rt = runtime_on(card, folder, "cuda:1")
    assert rt.lm.device == torch.device("cuda", 1)
    assert {index for name, index in card.calls if name == "mem_get_info"} == {1}
    card.current = 1  # what torch.cuda.set_device(1) (or CUDA_VISIBLE_DEVICES) makes current
    assert runtime_on(card, folder, "cuda").lm.device == torch.device("cuda", 1)


def generate_json(capsys, folder, *flags):
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--model", folder, "--prompt", "the cat sat on the mat", "--max-new-tokens", "6",
              "--json", *flags])
    out, err = capsys.readouterr()
    return exit_info.value.code, out, err


def test_generate_with_each_device_string_runs_with_its_defaults(card, folder, capsys):
    results = {}
    for device in SAME:
        with card.placement():
            code, out, err = generate_json(capsys, folder, "--device", device)
        assert code == 0, err
        results[device] = json.loads(out)
    first = results["auto"]
    assert first["device"] == "cuda:0" and first["plan"]["profile"] == "auto:Simulated 24 GB card"
    for device in SAME[1:]:
        assert results[device]["tokens"] == first["tokens"] and steady(results[device]["plan"]) == steady(first["plan"]), device
    with card.placement():  # the tokens are the CPU's: the simulated card computes on the host
        code, out, err = generate_json(capsys, folder, "--device", "cpu", "--dtype", "bfloat16",
                                       "--method", first["method"])
    assert code == 0, err
    assert json.loads(out)["tokens"] == first["tokens"]


def test_generate_on_a_missing_card_is_one_error_line(card, folder, capsys):
    with card.placement():
        code, out, err = generate_json(capsys, folder, "--device", "cuda:1")
    assert code == 1 and out == ""
    assert err.strip() == "triforce: error: --device cuda:1: this machine has 1 CUDA device(s), cuda:0 to cuda:0"


def test_one_named_card_cannot_hold_several_ranks(card, folder, capsys):
    code, out, err = generate_json(capsys, folder, "--device", "cuda:0", "--tp", "2")
    assert code == 1 and "--device cuda:0 names one card, but --tp 2 runs rank N on cuda:N" in err


def test_a_card_no_profile_names_says_its_rates_are_nominal(card, folder, capsys):
    """Issue 74: an unknown card planned with a 4090's rates and said nothing."""
    rt = runtime_on(card, folder, "cuda")
    err = capsys.readouterr().err
    assert rt.profile.name == "auto:Simulated 24 GB card" and "its rates nominal" in rt.profile.description
    assert "profile auto:Simulated 24 GB card: read from the card at start, its rates nominal" in err
    assert "`triforce profile tune` measures them" in err and "host memory: " in err
