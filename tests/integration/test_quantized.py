"""Weights as GGUF blocks (Q8_0, Q4_0, Q4_1, Q4_K): the blocks de-quantize as the gguf package does;
the kernels equal de-quantize-then-matmul and give a row the same result in any pass; every
method's greedy tokens equal ar's over the same quantized model (float64 activations); the
default model's own Q4_1 file runs as shipped through `generate --quantize gguf`, its blocks (never
made float) hold the float load's weights in the same row order, and blocks that do not match
given float weights are refused."""
import json

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize, quantize

from triforce.cli.main import main
from triforce.config import SamplingParams
from triforce.decoding.engine import Engine
from triforce.kernels.cpu.linear.block_formats import FORMATS, HELD_BYTES, BlockWeight
from triforce.kernels.cpu.linear.q4_k import quantize_q4_k
from triforce.kernels.cpu.linear import blocks
from triforce.kernels.cpu.linear.blocks import QuantLinear
from triforce.model import quantized
from triforce.model.loading import load_model
from test_greedy_equivalence import TINY_PROMPTS, tiny_spec

KINDS = tuple(FORMATS)
WIDTH = {"q4_k": 512}  # Q4_K rows hold whole super-blocks of 256


@pytest.mark.parametrize("kind", KINDS)
def test_blocks_dequantize_as_the_gguf_package(kind):
    cols = WIDTH.get(kind, 96)
    w = torch.randn(48, cols, generator=torch.Generator().manual_seed(0))
    raw = quantize_q4_k(w.numpy()) if kind == "q4_k" else quantize(w.numpy(), FORMATS[kind])
    block = BlockWeight.from_raw(kind, raw, 48, cols)
    expected = torch.from_numpy(dequantize(raw, FORMATS[kind]).reshape(48, cols))
    if kind == "q4_k":  # held as Q4_1 blocks, exact: the package's own numbers from them
        assert torch.sqrt(torch.mean((expected - w) ** 2)) < 0.1 * w.std()
    else:
        assert np.array_equal(block.raw(), raw)  # the split arrays hold every bit of the file's blocks
    assert torch.equal(block.dequantized(), expected)
    assert torch.equal(block.take_rows(torch.tensor([5, 0, 5])), expected[[5, 0, 5]])
    order = np.arange(48)[::-1].copy()
    assert torch.equal(block.permute_rows(order).dequantized(), expected[order])
    stacked = BlockWeight.stack([block, block.permute_rows(order)])
    assert torch.equal(stacked.dequantized(), torch.cat([expected, expected[order]]))
    assert block.nbytes == 48 * cols // 32 * HELD_BYTES[kind]  # what the planner counts
    assert block.nbytes <= (1.2 if kind != "q4_k" else 4 / 3) * block.file_nbytes  # Q4_K: float32 sub-block scales


# both vector widths on every host: 16 lanes run where AVX-512 is, and LLVM splits them into two
# 8-lane halves elsewhere, so a host without AVX-512 still checks the 16-lane kernels' code
LANE_CHOICES = [False, True]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("wide", LANE_CHOICES, ids=lambda w: "16-lanes" if w else "8-lanes")
def test_kernels_equal_dequantize_then_matmul(kind, dtype, wide, monkeypatch):
    monkeypatch.setattr(blocks, "WIDE_BLOCKS", wide)
    g = torch.Generator().manual_seed(1)
    cols = WIDTH.get(kind, 320)  # 10 blocks: the offsets' dot has a vector part and a tail
    block = BlockWeight.quantize(kind, torch.randn(80, cols, generator=g) * 0.1)
    bias = torch.randn(80, generator=g)
    linear = QuantLinear(block, bias)
    reference = block.dequantized().to(dtype)
    x = torch.randn(40, cols, generator=g, dtype=dtype)
    for rows in (1, 5, 16, 40):  # 40: past SMALL_ROWS, de-quantized tiles into a GEMM
        got = linear(x[:rows])
        expected = x[:rows] @ reference.T + bias.to(dtype)
        assert got.dtype == dtype
        torch.testing.assert_close(got, expected, rtol=1e-5 if dtype == torch.float32 else 1e-12, atol=1e-5)
    for rows in (2, 3, 7, 9):  # groups of 4, then 1, 2 or 3 rows sharing a block's unpacking
        together = linear(x[:rows])
        for i in range(rows):  # a token's numbers do not depend on the rest of its pass
            assert torch.equal(linear(x[i:i + 1])[0], together[i]), (rows, i)


@pytest.mark.parametrize("bf16_gemm", [True, False])
def test_a_bfloat16_prefill_takes_the_bfloat16_gemm_where_the_cpu_has_one(monkeypatch, bf16_gemm):
    """Past SMALL_ROWS, bfloat16 rows meet bfloat16 tiles (the CPU's BF16 dot products) or float32
    ones; decoding rows and a float32 head never change."""
    from triforce.kernels.cpu.linear import blocks

    monkeypatch.setattr(blocks, "BF16_GEMM", bf16_gemm)
    g = torch.Generator().manual_seed(3)
    block = BlockWeight.quantize("q4_1", torch.randn(96, 128, generator=g) * 0.1)
    bias = torch.randn(96, generator=g)
    x = torch.randn(40, 128, generator=g).to(torch.bfloat16)
    weight = block.dequantized()
    tiles = []
    monkeypatch.setattr(blocks.F, "linear", lambda a, w, *b: tiles.append(w.dtype) or a @ w.T)
    got = QuantLinear(block, bias)(x)
    assert got.dtype == torch.bfloat16 and set(tiles) == {torch.bfloat16 if bf16_gemm else torch.float32}
    as_none = x.float() @ weight.to(torch.bfloat16).float().T + bias  # what --quantize none computes
    torch.testing.assert_close(got.float(), as_none, rtol=2e-2, atol=2e-2)
    tiles.clear()
    head = QuantLinear(block, keep_float32=True)(x)
    assert head.dtype == torch.float32 and set(tiles) == {torch.float32}


@pytest.fixture(scope="module", params=["q4_1", "q8_0", "q4_k"])
def quantized_pair(request, tiny_model_dir):
    wide = {"hidden_size": 256} if request.param == "q4_k" else {}  # whole Q4_K super-blocks
    target = load_model(str(tiny_model_dir("llama-gqa", **wide)), dtype="float64", device="cpu",
                        quantize=request.param)
    draft = load_model(str(tiny_model_dir("llama-gqa", seed=7, num_layers=1, hidden_size=32)), dtype="float64",
                       device="cpu", quantize=request.param)
    return target, draft


def test_every_method_over_quantized_weights_equals_ar(quantized_pair):
    target, draft_model = quantized_pair
    assert target.quantized["weights"] in KINDS
    assert draft_model.quantized["weights"] in ("q4_1", "q8_0")  # 32-wide rows: q4_k falls back to q4_1
    for text in TINY_PROMPTS[:6]:
        ids = target.tokenizer(text).input_ids
        expected = _decode(target, "ar", ids)
        for method in ("triforce", "retrieval", "streaming", "snapkv", "naive"):
            for draft in ([draft_model, "lookup"] if tiny_spec(method).uses_draft else [None]):
                assert _decode(target, method, ids, draft) == expected, (method, text)


def _decode(lm, method, ids, draft=None, new_tokens=20):
    engine = Engine(lm, tiny_spec(method), len(ids) + new_tokens, draft)
    engine.set_sequence(ids)
    return engine.generate(new_tokens, SamplingParams()).tokens


def test_fused_kernels_equal_the_reference_modules(quantized_pair):
    target, _ = quantized_pair
    ids = torch.tensor([target.tokenizer(TINY_PROMPTS[0]).input_ids])
    from triforce.cache.resident import ResidentKVCache

    def logits():
        cache = ResidentKVCache(target.config, 64, dtype=target.dtype)
        return target.model(ids, torch.arange(ids.shape[1])[None], cache.step(ids.shape[1]))

    fused = logits()
    target.model.use_kernels("reference")
    try:
        torch.testing.assert_close(logits(), fused, rtol=1e-10, atol=1e-10)
    finally:
        target.model.use_kernels("fused")


def test_the_default_models_own_blocks_run_through_generate(capsys):
    with pytest.raises(SystemExit) as done:
        main(["generate", "--prompt", "The capital of France is", "--quantize", "gguf", "--dtype", "float32",
              "--method", "ar", "--max-new-tokens", "6", "--json"])
    out, err = capsys.readouterr()
    assert done.value.code == 0, err
    report = json.loads(out)
    assert report["quantized"]["weights"] == "q4_1/q8_0"  # projections Q4_1, tied embeddings Q8_0
    assert report["quantized"]["bytes"] <= 1.2 * report["quantized"]["file_bytes"]
    assert len(report["tokens"]) == 6
    from triforce.model.architectures import arch_config
    from triforce.offload.shapes import matrix_weights, weight_bytes
    shape = arch_config("smollm2-135m")  # the plan counts the blocks as loaded, the norms in float32
    norms = weight_bytes(shape, 4) - 4 * matrix_weights(shape)
    assert report["plan"]["weight_format"] == "q4_1/q8_0"
    assert report["plan"]["breakdown"]["target_weights"] == report["quantized"]["bytes"] + norms


def test_the_default_models_blocks_match_a_bfloat16_load(capsys):
    """--dtype auto is bfloat16 on a CPU with native bfloat16 (AVX-512 BF16): the file's blocks are
    matched to the conversion's weights in that dtype. They were compared in float32 against the
    bfloat16 weights, and `triforce chat` refused the default model on such CPUs."""
    report = _generate_json(capsys, "--quantize", "gguf", "--dtype", "bfloat16")
    assert report["quantized"]["weights"] == "q4_1/q8_0" and report["dtype"] == "bfloat16"


def _generate_json(capsys, *extra):
    with pytest.raises(SystemExit) as done:
        main(["generate", "--prompt", "The capital of France is", "--method", "ar", "--max-new-tokens", "2",
              "--json", *extra])
    out, err = capsys.readouterr()
    assert done.value.code == 0, err
    return json.loads(out)


def test_the_default_model_runs_as_shipped_unless_told_otherwise(capsys):
    """--quantize auto: the file's blocks where the block kernels serve (a CPU with FMA) and
    --dtype is left to auto; --dtype or --quantize none give de-quantized floats."""
    from triforce.kernels.cpu.simd.f32_dot import HAS_F32_FMA

    shipped = _generate_json(capsys)["quantized"]
    assert (shipped or {}).get("weights") == ("q4_1/q8_0" if HAS_F32_FMA else None)
    assert _generate_json(capsys, "--dtype", "float32")["quantized"] is None
    assert _generate_json(capsys, "--quantize", "none")["quantized"] is None


def test_a_file_with_other_block_formats_falls_back_to_floats_under_auto(monkeypatch):
    monkeypatch.setattr(quantized, "format_of", lambda kind: None)  # as if every tensor were Q6_K
    lm = load_model("default", dtype="float32", device="cpu", quantize="gguf", quantize_required=False)
    assert lm.quantized is None
    from triforce.errors import UserError
    with pytest.raises(UserError, match="holds no tensor in a block format"):
        load_model("default", dtype="float32", device="cpu", quantize="gguf")


def test_a_file_mixing_formats_runs_its_blocks_and_keeps_the_rest_float(monkeypatch, tmp_path,
                                                                       default_model_dir):
    """As a Q4_K_M file mixes Q4_K with Q6_K and Q5_K: here every attn_v and ffn_down is stored F16
    (and the embeddings' Q8_0 taken as a format without kernels), so they stay float beside the
    blocks, and a layer's q/k/v run apart and are joined. Logits equal the float model's up to
    float order."""
    from gguf_files import copy_gguf
    from triforce.model.loading import gguf_file
    from triforce.model.quantized_layers import JoinedOutputs

    mixed_file = copy_gguf(gguf_file("default"), tmp_path / "mixed.gguf", as_f16=("attn_v", "ffn_down"))
    monkeypatch.setenv("TRIFORCE_CACHE", str(tmp_path / "cache"))
    real_format = quantized.format_of
    monkeypatch.setattr(quantized, "format_of", lambda kind: None if kind == gguf.GGMLQuantizationType.Q8_0
                        else real_format(kind))
    mixed = load_model(str(mixed_file), dtype="float32", device="cpu", quantize="gguf")
    floats = load_model(str(mixed_file), dtype="float32", device="cpu")
    cached = [p for p in (tmp_path / "cache").rglob("*") if p.is_file()]  # the weights stay in the file
    assert sum(p.stat().st_size for p in cached) < 8e6 and not [p for p in cached if p.suffix == ".safetensors"]
    assert mixed.quantized["weights"] == "q4_1"
    layer = mixed.model.model.layers[0]
    assert isinstance(layer.self_attn.fused[0], JoinedOutputs) and isinstance(mixed.model.model.embed_tokens,
                                                                             torch.nn.Embedding)
    ids = torch.tensor([mixed.tokenizer("The capital of France is Paris, and the capital of Italy").input_ids])
    from triforce.cache.resident import ResidentKVCache

    def logits(lm):
        cache = ResidentKVCache(lm.config, 64, dtype=lm.dtype)
        return lm.model(ids, torch.arange(ids.shape[1])[None], cache.step(ids.shape[1]))

    torch.testing.assert_close(logits(mixed), logits(floats), rtol=1e-4, atol=1e-4)


def test_blocks_read_from_the_file_hold_the_float_loads_weights(default_lm):
    """The blocks are never made float: each must de-quantize to the weight the float path reads
    from the same file, q and k rows included (Llama files store them permuted)."""
    from triforce.model.quantized_layers import QuantizedLinear

    blocks = load_model("default", dtype="float32", device="cpu", quantize="gguf")
    floats = dict(default_lm.model.named_parameters())
    checked = 0
    for name, module in blocks.model.named_modules():
        if isinstance(module, QuantizedLinear):
            expected = floats[f"{name}.weight" if name != "lm_head" else "model.embed_tokens.weight"]
            assert torch.equal(module.block.dequantized(), expected), name
            checked += 1
    assert checked == 7 * blocks.config.num_layers + 1


def test_blocks_that_do_not_match_given_float_weights_are_refused(default_lm, monkeypatch):
    """Planted: the Llama row permutation of q and k is not undone."""
    import copy

    from triforce.errors import UserError
    from triforce.model.loading import gguf_file
    monkeypatch.setattr(quantized, "_row_orders", lambda rows, heads: iter([None]))
    with pytest.raises(UserError, match="does not de-quantize to the model's float weight"):
        quantized.quantize_model(copy.deepcopy(default_lm.model), "gguf", gguf_file("default"))


def test_quantize_is_refused_where_it_cannot_run(tiny_model_dir):
    from triforce.errors import UserError
    with pytest.raises(UserError, match="--quantize gguf needs a model loaded from a .gguf file"):
        load_model(str(tiny_model_dir("llama-gqa")), dtype="float32", device="cpu", quantize="gguf")
    from triforce.app.runtime import _load
    with pytest.raises(UserError, match="--quantize gguf goes with --model"):
        _load("llama-68m", None, "float32", "cpu", None, None, "gguf")
    assert gguf.GGMLQuantizationType.Q4_1 == FORMATS["q4_1"]


def test_tensor_positions_are_read_once_and_kept(monkeypatch, tmp_path):
    """The gguf package parses the file's metadata once; later loads map the tensors from the
    cached index (a torn index is read again), with the same bytes as the package's reader."""
    from triforce.model import gguf_index
    from triforce.model.loading import gguf_file

    path = gguf_file("default")
    monkeypatch.setenv("TRIFORCE_CACHE", str(tmp_path))  # the index goes here
    first = gguf_index.gguf_tensors(path)
    reader = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    assert first.keys() == reader.keys()
    for name in ("token_embd.weight", "blk.3.attn_q.weight", "blk.0.ffn_norm.weight"):
        assert first[name].tensor_type == reader[name].tensor_type
        assert np.array_equal(first[name].data, np.asarray(reader[name].data).view(np.uint8).reshape(-1))
    (index,) = (tmp_path / "gguf-index").iterdir()

    def no_parse(*args, **kwargs):
        raise AssertionError("the file's metadata was parsed again")

    monkeypatch.setattr(gguf, "GGUFReader", no_parse)
    gguf_index._tensors.cache_clear()  # a later process: only the index on disk is left
    again = gguf_index.gguf_tensors(path)
    assert {n: (t.offset, t.n_bytes) for n, t in again.items()} == {n: (t.offset, t.n_bytes) for n, t in first.items()}
    index.write_text('{"version": 1, "tens')  # torn
    gguf_index._tensors.cache_clear()
    with pytest.raises(AssertionError, match="parsed again"):
        gguf_index.gguf_tensors(path)


def test_a_random_weight_architecture_takes_random_blocks():
    """--arch with --quantize (bench offload, tier_steps): projections and head as random blocks,
    the embedding float; the block kernels equal the reference modules over them."""
    from triforce.app.runtime import _load
    from triforce.cache.resident import ResidentKVCache
    from triforce.model.quantized_layers import QuantizedLinear

    lm = _load("llama-68m", None, "float32", "cpu", None, None, "q4_k")
    assert lm.quantized["weights"] == "q4_k" and isinstance(lm.model.lm_head, QuantizedLinear)
    assert all(isinstance(layer.mlp.down_proj, QuantizedLinear) for layer in lm.model.model.layers)
    assert lm.quantized["bytes"] == lm.quantized["block_weights"] * 24 // 32
    tokens = torch.tensor([[5, 99, 1234, 7, 31999]])

    def logits():
        cache = ResidentKVCache(lm.config, 8, dtype=lm.dtype)
        return lm.model(tokens, torch.arange(5)[None], cache.step(5))

    fused = logits()
    lm.model.use_kernels("reference")
    torch.testing.assert_close(logits(), fused, rtol=1e-4, atol=1e-4)
    assert fused.isfinite().all() and 0.1 < fused.std() < 10
