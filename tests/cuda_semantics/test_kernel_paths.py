"""The kernels a GPU would run, seen on a simulated card: a bfloat16 prompt prefilled through the
offloaded path and decoded with triforce takes no float32 tiled fallback (every causal block of
the layer-major prefill and each verify's own new tokens fuse; before issue 52 the CUDA branch
sent them all to partial_attention's float32 tiles; blocks whose keys run past some of a long
group's queries fuse piece by piece), and a bfloat16 head gives float32 logits that are not
bfloat16 results widened."""
import importlib

import pytest

import torch

from card_tensors import CardTensors
from cli_json import run_json
from triforce.kernels.cpu.linear.dense import FusedLinear

attention = importlib.import_module("triforce.kernels.attention")  # the package exports a function of that name

PROMPT = "the cat sat on the mat. the cat sat on the hat. the cat and the dog sat on the log. the cat sat on" * 8


@pytest.fixture(scope="module")
def folder(tiny_model_dir):
    return str(tiny_model_dir("llama-gqa", max_position_embeddings=1024, num_layers=2))


def test_an_offloaded_bf16_prefill_and_decode_take_no_float32_fallback(capsys, card, checked, folder, monkeypatch):
    fallbacks, fused = [], []
    real_tiled, real_fused = attention.partial_attention, attention.fused_partial

    def tiled(q, *args, **kwargs):
        fallbacks.append((q.dtype, q.shape[2]))
        return real_tiled(q, *args, **kwargs)

    def counted(q, *args, **kwargs):
        fused.append(kwargs.get("shape"))
        return real_fused(q, *args, **kwargs)

    monkeypatch.setattr(attention, "partial_attention", tiled)
    monkeypatch.setattr(attention, "fused_partial", counted)
    with card.placement():
        report = run_json(capsys, "generate", "--model", folder, "--prompt", PROMPT, "--device", "cuda", "--dtype",
                          "bfloat16", "--device-budget", "1.85MB", "--method", "triforce", "--draft", "lookup",
                          "--no-graphs", "--max-new-tokens", "12", "--budget", "48", "--chunk-size", "4", "--json")
    assert report["plan"]["offloaded"] and report["dtype"] == "bfloat16"
    assert fallbacks == [], f"{len(fallbacks)} blocks took the float32 tiles, e.g. {fallbacks[:3]}"
    assert "diagonal" in fused and "whole" in fused  # the new tokens' own block, and the old keys


def test_a_bf16_head_on_the_card_gives_float32_sums():
    mode = CardTensors()
    g = torch.Generator().manual_seed(0)
    weight = (torch.randn(512, 256, generator=g) * 0.05).to(torch.bfloat16)
    x = torch.randn(3, 256, generator=g).to(torch.bfloat16)
    exact = x.double() @ weight.double().t()
    with mode:
        logits = FusedLinear(weight.to("cuda"), keep_float32=True)(x.to("cuda"))
    assert logits.dtype == torch.float32
    assert float((logits.double() - exact).abs().max()) < 1e-4  # a bfloat16 result is off by ~1e-2


def test_a_torch_without_float32_sums_falls_back_once_with_a_note(monkeypatch, capsys):
    """torch.mm's out_dtype is CUDA-only and recent: where it raises, the head says so once and
    gives its bfloat16 results widened, as before, instead of failing every step."""
    from triforce.kernels.cpu.linear import dense as cpu_linear

    calls = []

    def missing(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("mm.dtype is not available")

    monkeypatch.setattr(cpu_linear, "linear_float32", missing)
    weight = torch.randn(64, 32).to(torch.bfloat16)
    with CardTensors():
        head = FusedLinear(weight.to("cuda"), keep_float32=True)
        first = head(torch.randn(2, 32).to(torch.bfloat16).to("cuda"))
        head(torch.randn(2, 32).to(torch.bfloat16).to("cuda"))
    assert first.dtype == torch.float32 and len(calls) == 1
    assert head.float32_sums_failed == "mm.dtype is not available"
    assert capsys.readouterr().err.count("float32 logits unavailable") == 1


@pytest.mark.parametrize("dtype,on_card", [(torch.float32, False), (torch.bfloat16, True)])
@pytest.mark.parametrize("num_queries,q_start,k_start,num_keys", [
    (300, 0, 0, 100),      # a layer-major prefill's queries over the resident head: keys end before them
    (300, 0, 100, 200),    # ... over their own new keys, which the first 100 queries precede
    (50, 20, 40, 60),      # some queries before the block, some among it, some after it
    (40, 10, 5, 20),       # keys from before the queries, ending among them
])
def test_blocks_whose_keys_run_past_some_queries_fuse_by_piece(monkeypatch, dtype, on_card, num_queries, q_start,
                                                              k_start, num_keys):
    """A prefill group longer than the resident head saw blocks no single fused shape serves, and
    took the float32 tiles: a 4K-token offloaded prefill of the default model on a 700 MB budget in
    19.4 s against 9.4 s on 600 MB. Each piece now takes the fused kernel (on a simulated card in
    bfloat16 too), with partial_attention's result."""
    from triforce.kernels import SDPA
    from triforce.kernels.partial import causal_pieces, partial_attention

    tiled = []
    monkeypatch.setattr(attention, "partial_attention", lambda *a, **k: tiled.append(1))
    g = torch.Generator().manual_seed(num_queries + k_start)
    q = torch.randn(1, 6, num_queries, 64, generator=g).to(dtype)
    k, v = (torch.randn(1, 2, num_keys, 64, generator=g).to(dtype) for _ in range(2))
    assert [p[3] for p in causal_pieces(num_queries, num_keys, q_start, k_start)] != ["whole"]
    if on_card:
        with CardTensors():
            out, lse = SDPA.partial(q.to("cuda"), k.to("cuda"), v.to("cuda"), scale=0.125, q_start=q_start,
                                    k_start=k_start)
    else:
        out, lse = SDPA.partial(q, k, v, scale=0.125, q_start=q_start, k_start=k_start)
    ref_out, ref_lse = partial_attention(q.double(), k.double(), v.double(), scale=0.125, q_start=q_start,
                                         k_start=k_start)
    assert tiled == [] and out.dtype == lse.dtype == torch.float32
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), ref_out, atol=tolerance, rtol=tolerance)
    seen = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), seen)  # queries before the block see nothing in both
    torch.testing.assert_close(lse.double()[seen], ref_lse[seen], atol=tolerance, rtol=1e-3)
