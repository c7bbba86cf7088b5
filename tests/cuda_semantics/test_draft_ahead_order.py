"""`generate --draft-ahead --device cuda` on a simulated card under the checked streams fake,
following every tensor: the verify runs on a worker thread on the compute stream while the tier
below drafts on a stream of its own, and every hand-over between the two is ordered. Greedy tokens
equal the run without drafting ahead; planted bugs (either stream wait removed) fail."""
import json
import threading

import pytest

from checked_streams import CheckedStreams, StreamOrderError
from triforce.cli.main import main
from triforce.decoding import draft_ahead
from triforce.decoding.full_tier import FullTier
from triforce.offload import prefetcher

PROMPT = "the cat sat on the mat. the cat sat on the hat. the cat and the dog sat on the log. the cat sat on"
WAIT_BEFORE = "            streams.wait_stream(mine, main)"
WAIT_AFTER = "                streams.wait_stream(main, mine)"


@pytest.fixture(scope="module")
def folder(tiny_model_dir):
    return str(tiny_model_dir("llama-gqa", max_position_embeddings=512))


@pytest.fixture
def followed(card, pinning, monkeypatch):
    """One CheckedStreams following every tensor, for the prefetcher and the drafting ahead."""
    fake = CheckedStreams(follow_all=True)
    monkeypatch.setattr(prefetcher, "streams_for", lambda device: fake)
    monkeypatch.setattr(draft_ahead, "streams_for", lambda device: fake)
    return fake


def generate(capsys, card, fake, folder, *flags, prompt=PROMPT):
    with card.placement(), fake.watching():  # --no-graphs: a simulated card captures no CUDA graphs
        with pytest.raises(SystemExit) as exit_info:
            main(["generate", "--model", folder, "--prompt", prompt, "--device", "cuda", "--method", "triforce",
                  "--max-new-tokens", "16", "--budget", "48", "--chunk-size", "4", "--no-graphs", "--json", *flags])
    out, err = capsys.readouterr()
    assert exit_info.value.code == 0, err
    return json.loads(out)


def verify_threads(monkeypatch) -> set:
    names: set = set()
    real = FullTier.verify

    def verify(self, *args, **kwargs):
        names.add(threading.current_thread().name)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(FullTier, "verify", verify)
    return names


@pytest.mark.parametrize("offload", [[], ["--dtype", "float32", "--device-budget", "1.9MB"]], ids=["resident", "offloaded"])
def test_drafting_ahead_on_a_card_is_ordered_and_lossless(capsys, card, followed, folder, monkeypatch, offload):
    prompt = PROMPT * 4 if offload else PROMPT  # 392 tokens: at 1.9MB in float32, 256 stay resident and the rest go to the host
    plain = generate(capsys, card, CheckedStreams(follow_all=True), folder, "--temperature", "0", *offload,
                     prompt=prompt)
    threads = verify_threads(monkeypatch)
    ahead = generate(capsys, card, followed, folder, "--temperature", "0", "--draft-ahead", *offload, prompt=prompt)
    assert ahead["device"] == "cuda:0" and ahead["tokens"] == plain["tokens"]
    assert ahead["draft_ahead_rounds"] > 0 and any(t.startswith("full-verify") for t in threads)
    drafted = sum(n for name, n in followed.accesses_by.items() if name.startswith("drafting stream"))
    assert drafted > 100, followed.accesses_by
    if offload:
        assert ahead["plan"]["offloaded"] and followed.copies > 0, json.dumps(ahead["plan"])


@pytest.mark.parametrize("seed", [["--seed", "3"], []], ids=["seeded", "speculative-sampling"])
def test_sampled_drafting_ahead_on_a_card_is_ordered(capsys, card, followed, folder, seed):
    """Seeded: each token by its position's noise; unseeded: speculative sampling's test of each draft."""
    result = generate(capsys, card, followed, folder, "--temperature", "0.7", *seed, "--draft-ahead", "--ignore-eos")
    assert result["draft_ahead_rounds"] > 0 and len(result["tokens"]) == 16


def planted(monkeypatch, line: str) -> None:
    """AheadRunner.run with one line removed."""
    import inspect
    import textwrap

    source = textwrap.dedent(inspect.getsource(draft_ahead.AheadRunner.run))
    assert textwrap.dedent(line).strip() in source
    source = source.replace(textwrap.dedent(line).strip(), "pass  # planted: wait removed")
    namespace: dict = {}
    exec(compile(source, draft_ahead.__file__, "exec"), vars(draft_ahead), namespace)
    monkeypatch.setattr(draft_ahead.AheadRunner, "run", namespace["run"])


@pytest.mark.parametrize("line,temperature", [(WAIT_BEFORE, "0"), (WAIT_AFTER, "0.7")],
                         ids=["drafting-before-the-commit-lands", "verify-reads-drafts-unwaited"])
def test_planted_bug_a_missing_stream_wait_is_caught(capsys, card, followed, folder, monkeypatch, line, temperature):
    planted(monkeypatch, line)
    with pytest.raises(StreamOrderError) as caught:
        generate(capsys, card, followed, folder, "--temperature", temperature, "--seed", "3", "--draft-ahead")
    assert "drafting stream" in str(caught.value)


@pytest.mark.slow
def test_the_hybrid_verify_inside_the_verify_worker_keeps_the_thread_count(capsys, card, followed, tiny_model_dir,
                                                                          tmp_path, monkeypatch):
    """--draft-ahead with the hybrid verify on: the verify runs on the draft-ahead worker, which
    starts the CPU's share on the host-attention worker; both run numba on --threads threads."""
    import numba

    from sync_budget import PROMPT as LONG, small_block_profile
    from triforce.cache import offloaded

    seen = []
    real = offloaded.host_partial

    def host_partial(*args, **kwargs):
        seen.append((threading.current_thread().name.rsplit("_", 1)[0], numba.get_num_threads()))
        return real(*args, **kwargs)

    monkeypatch.setattr(offloaded, "host_partial", host_partial)
    threads = verify_threads(monkeypatch)
    folder = str(tiny_model_dir("llama-gqa", max_position_embeddings=1024, num_layers=4))
    result = generate(capsys, card, followed, folder, "--temperature", "0", "--draft-ahead", "--dtype", "float32",
                      "--device-budget", "3.0MB", "--profile", small_block_profile(tmp_path), "--threads", "1",
                      prompt=LONG)
    assert result["plan"]["hybrid"] and result["draft_ahead_rounds"] > 0
    assert any(t.startswith("full-verify") for t in threads)
    assert seen and set(seen) == {("triforce-host-attention", 1)}


def test_no_graph_is_captured_while_the_verify_runs_beside(capsys, card, followed, folder, monkeypatch):
    """A capture makes other threads' allocations and syncs illegal (and used to synchronise the
    device): while the verify runs on the draft-ahead worker, a drafting step without a graph runs
    uncaptured. Here every graph is dropped as each drafting-ahead round starts, so its steps have
    none; without the hold they were captured there (seen: this test failed)."""
    from triforce.decoding import graph_runner

    card.install_graphs(monkeypatch)
    runners, beside, captures = [], threading.Event(), []
    real_init, real_capture, real_run = (graph_runner.TierRunner.__init__, graph_runner.TierRunner._capture,
                                         draft_ahead.AheadRunner.run)

    def init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        runners.append(self)

    def capture(self, view):
        captures.append(beside.is_set())
        return real_capture(self, view)

    def run(self, verify, draft):
        for runner in runners:
            runner._graphs.clear()
        beside.set()
        try:
            return real_run(self, verify, draft)
        finally:
            beside.clear()

    monkeypatch.setattr(graph_runner.TierRunner, "__init__", init)
    monkeypatch.setattr(graph_runner.TierRunner, "_capture", capture)
    monkeypatch.setattr(draft_ahead.AheadRunner, "run", run)
    with card.placement(), followed.watching():
        with pytest.raises(SystemExit) as exit_info:
            main(["generate", "--model", folder, "--prompt", PROMPT, "--device", "cuda", "--method", "triforce",
                  "--max-new-tokens", "16", "--budget", "48", "--chunk-size", "4", "--draft-ahead", "--json"])
    out, err = capsys.readouterr()
    assert exit_info.value.code == 0, err
    report = json.loads(out)
    assert report["draft_ahead_rounds"] > 0 and captures and runners
    assert not any(captures), f"{sum(captures)} of {len(captures)} captures ran beside the verify"
    assert all(r["graph_failed"] is None for r in report["graphs"].values())
