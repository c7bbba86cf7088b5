"""Issue 71: a seed gives one text, whatever produced it. The same seeded request decodes to the
same tokens under every method (plain decoding is the reference), with drafting ahead, on a
cache that already holds the prompt, and from the command line as from the API; the answers of
many seeds follow the target's distribution (chi-square, tests/integration/test_sampling_distribution)."""
import json

import pytest

from test_cli import run_cli

SEEDS = range(12)
PROMPT = "ecceadbabacdbdeaebabdcbdbabeedbbaabbbbccbebbbdcacdbbcacceeaecacccdcbddbacacdaedcdeadabebab"  # 90 tokens
SMALL = dict(budget=40, chunk_size=2, gamma1=2, gamma2=3)  # sparse tiers that hold less than the prompt


@pytest.fixture(scope="module")
def folders(tiny_model_dir):
    """Target and draft over an 8-token vocabulary, peaked enough that drafts are often kept."""
    target = tiny_model_dir("llama-gqa", alphabet="abcde", seed=11, num_layers=1, hidden_size=32, weight_std=0.35)
    draft = tiny_model_dir("llama-gqa", alphabet="abcde", seed=12, num_layers=1, hidden_size=32, weight_std=0.35)
    return str(target), str(draft)


def _llm(folders, method, **kw):
    import triforce

    draft = folders[1] if method in ("triforce", "naive") else None
    extra = SMALL if method != "ar" else {}
    return triforce.LLM(folders[0], method=method, draft=draft, device="cpu", dtype="float32", max_context=128,
                        **extra, **kw)


def _texts(llm, seeds=SEEDS, temperature=1.0, **params):
    import triforce

    return [llm.generate(PROMPT, triforce.SamplingParams(temperature=temperature, seed=s, max_tokens=16,
                                                         ignore_eos=True, **params)).token_ids for s in seeds]


@pytest.fixture(scope="module")
def plain(folders):
    return _texts(_llm(folders, "ar"))


@pytest.mark.parametrize("method, kw", [("triforce", {}), ("triforce", {"draft_ahead": True}), ("naive", {}),
                                        ("retrieval", {}), ("streaming", {}), ("snapkv", {})])
def test_every_method_gives_a_seeds_plain_text(folders, plain, method, kw):
    import triforce

    llm = _llm(folders, method, **kw)
    assert _texts(llm) == plain
    stats = [llm.generate(PROMPT, triforce.SamplingParams(temperature=1.0, seed=s, max_tokens=16, ignore_eos=True)).stats
             for s in SEEDS]
    assert sum(st["accepted"]["full"] for st in stats) > 0  # drafts were kept, not only corrected


def test_filters_and_penalties_keep_it(folders):
    params = dict(temperature=0.8, top_k=4, top_p=0.9, repeat_penalty=1.3, presence_penalty=0.2)
    assert _texts(_llm(folders, "triforce"), **params) == _texts(_llm(folders, "ar"), **params)


def test_a_vocabulary_wider_than_the_host_loops_candidates_keeps_it(tiny_model_dir, monkeypatch):
    """97 words: chat's filters go through the host loop (kernels.cpu.distribution, 64 candidates),
    a verify's rows and a draft's single row alike, and rows whose nucleus is wider through the
    sorting path beside them."""
    import string

    from triforce.decoding import sampling

    wide = dict(alphabet=string.printable[:94], num_layers=1, hidden_size=32, weight_std=0.35)
    wide_folders = tuple(str(tiny_model_dir("llama-gqa", seed=seed, **wide)) for seed in (11, 12))
    shapes, loop = [], sampling.distribution.distributions
    monkeypatch.setattr(sampling.distribution, "distributions",
                        lambda calc, *a: shapes.append(calc.shape) or loop(calc, *a))
    params = dict(temperature=0.7, top_p=0.9, repeat_penalty=1.1)
    assert _texts(_llm(wide_folders, "triforce"), **params) == _texts(_llm(wide_folders, "ar"), **params)
    assert {len(shape) for shape in shapes} == {1, 2} and max(shape[0] for shape in shapes if len(shape) == 2) > 1


def test_a_cache_that_holds_the_prompt_gives_the_same_text(folders, plain):
    llm = _llm(folders, "triforce")
    assert _texts(llm) == plain and _texts(llm) == plain  # the second time over a warm engine


def test_the_command_line_gives_the_apis_text(capsys, folders, plain):
    for seed in (0, 5):
        code, out, err = run_cli(capsys, "generate", "--model", folders[0], "--draft", folders[1], "--method",
                                 "triforce", "--budget", "40", "--chunk-size", "2", "--gamma1", "2", "--gamma2", "3",
                                 "--max-context", "128", "--prompt", PROMPT, "--temperature", "1", "--seed", str(seed),
                                 "--max-new-tokens", "16", "--ignore-eos", "--json")
        assert code == 0, err
        assert json.loads(out)["tokens"] == plain[seed]
