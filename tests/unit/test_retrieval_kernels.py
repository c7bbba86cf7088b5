"""Each Triton retrieval kernel against its torch reference: on CUDA for real, on CPU through
Triton's interpreter (skipped when triton is not installed). Also the incremental chunk means
against recomputing them, and a whole retrieval rebuild through either kernel set."""
import pytest
import torch
from transformers import LlamaConfig

from triforce.cache.resident import ResidentKVCache
from triforce.cache.sparse import SelectionPolicy, SparseKVCache
from triforce.config.model import ModelConfig
from triforce.kernels import RetrievalKernels, chunk_mean_keys, gather_into, grouped_scores, topk_sorted
from triforce.kernels.chunk_means import ChunkMeans

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def rt():
    pytest.importorskip("triton")
    from triforce.kernels.cuda import retrieval_triton
    return retrieval_triton


@pytest.mark.parametrize("heads,kv_heads,dim,chunks", [(8, 2, 64, 300), (6, 2, 48, 17), (4, 4, 32, 129)])
def test_triton_chunk_scores_match_reference(rt, heads, kv_heads, dim, chunks):
    g = torch.Generator().manual_seed(heads + chunks)
    query = torch.randn(2, heads, dim, generator=g).to(DEVICE)
    store = torch.randn(2, kv_heads, chunks + 40, dim, generator=g).to(DEVICE)
    means = store[:, :, 5:5 + chunks]  # a strided view into a bigger buffer, as the caches pass
    got = rt.chunk_scores(query, means)
    assert got.dtype == torch.float32 and got.shape == (2, kv_heads, chunks)
    torch.testing.assert_close(got, grouped_scores(query, means), rtol=1e-5, atol=1e-4)


def test_reference_topk_is_the_k_largest_with_low_index_ties():
    scores = torch.tensor([[1.0, 3.0, 3.0, 0.5, 3.0, 2.0]])
    assert topk_sorted(scores, 2).tolist() == [[1, 2]]
    assert topk_sorted(scores, 4).tolist() == [[1, 2, 4, 5]]
    values = torch.randn(3, 50)
    picked = topk_sorted(values, 10)
    assert torch.equal(torch.sort(values.gather(-1, picked), -1).values,
                       torch.sort(torch.topk(values, 10).values, -1).values)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_gather_matches_reference(rt, dtype):
    g = torch.Generator().manual_seed(5)
    k_buf = torch.randn(3, 1, 2, 300, 64, generator=g).to(DEVICE, dtype)  # [L, B, Hkv, S, D]
    v_buf = torch.randn(3, 1, 2, 300, 64, generator=g).to(DEVICE, dtype)
    index = torch.sort(torch.randint(0, 250, (1, 2, 70), generator=g), -1).values.to(DEVICE)
    dst_k = torch.zeros(3, 1, 2, 100, 64, dtype=dtype, device=DEVICE)
    dst_v = torch.zeros_like(dst_k)
    rt.gather_into(k_buf[1, :, :, :250], v_buf[1, :, :, :250], index, dst_k[2, :, :, :70], dst_v[2, :, :, :70])
    ref_k, ref_v = torch.empty(1, 2, 70, 64, dtype=dtype, device=DEVICE), torch.empty(1, 2, 70, 64, dtype=dtype,
                                                                                      device=DEVICE)
    gather_into(k_buf[1], v_buf[1], index, ref_k, ref_v)
    assert torch.equal(dst_k[2, :, :, :70], ref_k) and torch.equal(dst_v[2, :, :, :70], ref_v)
    assert not dst_k[2, :, :, 70:].any() and not dst_k[:2].any()  # nothing written outside the view


def test_chunk_means_extend_incrementally_and_roll_back():
    keys = torch.randn(2, 1, 2, 100, 16, dtype=torch.float64)  # [L, B, Hkv, S, D]
    means = ChunkMeans.like(keys, 4)
    reads = []

    def keys_of(layer):
        def read(start, end):
            reads.append((start, end))
            return keys[layer, :, :, start:end]
        return read

    assert torch.equal(means.read(0, 10, keys_of(0)), chunk_mean_keys(keys[0, :, :, :40], 4))
    assert torch.equal(means.read(0, 15, keys_of(0)), chunk_mean_keys(keys[0, :, :, :60], 4))
    assert reads == [(0, 40), (40, 60)]  # only the chunks completed since the last read
    means.read(0, 15, keys_of(0))
    assert len(reads) == 2
    means.rollback(30)  # chunk 7 (tokens 28..31) is no longer complete
    keys[0, :, :, 28:60] += 1.0
    assert reads == [(0, 40), (40, 60)]
    assert torch.equal(means.read(0, 15, keys_of(0)), chunk_mean_keys(keys[0, :, :, :60], 4))
    assert reads[-1] == (28, 60)


def test_retrieval_rebuild_same_with_triton_and_torch_kernels(rt):
    cfg = ModelConfig.from_hf(LlamaConfig(vocab_size=10, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2))
    g = torch.Generator().manual_seed(7)
    full = ResidentKVCache(cfg, 600, device=DEVICE)
    step = full.step(530)
    for layer in range(cfg.num_layers):
        q, k, v = (torch.randn(1, h, 530, cfg.head_dim, generator=g).to(DEVICE) for h in (4, 2, 2))
        step.attend(layer, q, k, v)
    queries = [torch.randn(1, 4, cfg.head_dim, generator=g).to(DEVICE) for _ in range(cfg.num_layers)]
    policy = SelectionPolicy("retrieval", 128, 8)
    built = []
    for use_triton in (False, True):
        full.kernels = RetrievalKernels(use_triton)
        sparse = SparseKVCache(cfg, policy, 16, device=DEVICE)
        sparse.rebuild(full, queries)
        built.append(sparse)
    assert built[0].num_selected == built[1].num_selected == 122  # 15 chunks and the 2-token tail
    assert torch.equal(built[0].k_buf, built[1].k_buf) and torch.equal(built[0].v_buf, built[1].v_buf)


def test_a_failing_triton_kernel_hands_over_that_kernel_only(rt, capsys):
    kernels = RetrievalKernels(True)

    class Broken:
        def chunk_scores(self, query, means):
            raise RuntimeError("no compiler for this device")

        def gather_into(self, *args):
            raise AssertionError("the gather must stay on Triton")

    kernels._triton = Broken()
    query, means = torch.randn(1, 4, 8), torch.randn(1, 2, 30, 8)
    got = kernels.scores(query, means)
    assert got.dtype == torch.float32 and torch.equal(got, grouped_scores(query, means))
    assert kernels.failed == {"chunk scoring"} and kernels.name == "triton (torch chunk scoring)"
    assert "Triton chunk scoring kernel failed" in capsys.readouterr().err
    with pytest.raises(AssertionError, match="must stay on Triton"):  # the gather still runs Triton
        kernels.gather_into(None, None, torch.zeros(1, 1, 1, dtype=torch.long), None, None)


def test_a_bug_in_the_caller_is_not_swallowed(rt):
    kernels = RetrievalKernels(True)

    class Buggy:
        def chunk_scores(self, query, means):
            raise TypeError("chunk_scores() got an unexpected keyword argument")

    kernels._triton = Buggy()
    with pytest.raises(TypeError):
        kernels.scores(torch.randn(1, 4, 8), torch.randn(1, 2, 30, 8))
    assert not kernels.failed
