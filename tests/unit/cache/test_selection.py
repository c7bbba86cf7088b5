"""Selection policies against plain loop references (no model)."""
import torch

from triforce.cache.selection import select_retrieval, select_streaming, select_topk


def loop_retrieval(query, keys, budget, chunk):
    """Reference: score each complete chunk per KV head with a Python loop."""
    B, Hkv, S, D = keys.shape
    groups = query.shape[1] // Hkv
    n_chunks, tail = S // chunk, S % chunk
    picks = (budget - tail) // chunk - 1
    out = torch.empty(B, Hkv, (picks + 1) * chunk + tail, dtype=torch.long)
    for b in range(B):
        for h in range(Hkv):
            scores = []
            for c in range(1, n_chunks):
                mean_key = keys[b, h, c * chunk:(c + 1) * chunk].mean(0)
                score = sum(float(query[b, h * groups + g] @ mean_key) for g in range(groups))
                scores.append((score, c))
            best = sorted(c for _, c in sorted(scores, reverse=True)[:picks])
            chosen = [0] + best
            idx = [c * chunk + i for c in chosen for i in range(chunk)] + list(range(n_chunks * chunk, S))
            out[b, h] = torch.tensor(idx)
    return out


def test_retrieval_matches_loop_reference_with_gqa_and_tail():
    g = torch.Generator().manual_seed(0)
    for S, budget, chunk in [(103, 40, 8), (64, 16, 4), (37, 20, 3)]:
        keys = torch.randn(2, 3, S, 16, generator=g, dtype=torch.float64)
        query = torch.randn(2, 6, 16, generator=g, dtype=torch.float64)
        got = select_retrieval(query, keys, budget, chunk)
        assert torch.equal(got, loop_retrieval(query, keys, budget, chunk)), (S, budget, chunk)
        assert got.shape[-1] <= budget


def test_retrieval_keeps_first_chunk_and_finds_the_needle_chunk():
    keys = torch.zeros(1, 1, 80, 4, dtype=torch.float64)
    keys[0, 0, 40:48] = torch.tensor([5.0, 0, 0, 0])  # chunk 5 aligns with the query
    query = torch.tensor([[[1.0, 0, 0, 0]]], dtype=torch.float64)
    got = select_retrieval(query, keys, budget=16, chunk_size=8)[0, 0].tolist()
    assert got == list(range(0, 8)) + list(range(40, 48))


def test_retrieval_keeps_everything_within_budget():
    keys = torch.randn(1, 2, 10, 4)
    assert select_retrieval(torch.randn(1, 2, 4), keys, 16, 4)[0, 1].tolist() == list(range(10))


def test_streaming_is_sinks_plus_recent():
    got = select_streaming(1, 2, 50, budget=10, sink_tokens=3)
    assert got[0, 1].tolist() == [0, 1, 2] + list(range(43, 50))


def test_topk_matches_sorting_reference():
    g = torch.Generator().manual_seed(1)
    keys = torch.randn(1, 2, 30, 8, generator=g, dtype=torch.float64)
    query = torch.randn(1, 4, 8, generator=g, dtype=torch.float64)
    got = select_topk(query, keys, 7)
    for h in range(2):
        scores = [float(query[0, 2 * h] @ keys[0, h, i] + query[0, 2 * h + 1] @ keys[0, h, i]) for i in range(30)]
        expected = sorted(sorted(range(30), key=lambda i: -scores[i])[:7])
        assert got[0, h].tolist() == expected
