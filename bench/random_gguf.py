"""A GGUF file of a named architecture with random weights, laid out as llama.cpp's `llama-quantize`
lays out a Q4_K_M or Q8_0 file of it, so that llama.cpp and triforce time the same bytes.

    python -m triforce.bench.random_gguf OUT.gguf --arch llama3.1-8b [--type q4_k_m|q8_0] [--layers N]

Q4_K_M as llama.cpp assigns it to a dense model (src/llama-quant.cpp): q4_k everywhere but the
head (q6_k; the embedding too where it is tied to the head), and attn_v and ffn_down in q6_k for
the first and last eighth of the layers and every third layer between; norms float32. Q8_0: every
matrix q8_0. The quants are random bytes (copied from one random pool, so a 19 GB file is written
at the disk's speed: no float weights are ever made); each block's scales are set so the weights
spread about as std 0.02 and nothing is NaN or infinite. The tokenizer is the default model's
(SmolLM2's BPE), padded with unused tokens to the architecture's vocabulary, so the head and the
embedding have their real sizes. RoPE scaling of the yarn and linear kinds is written; llama3's
frequency table is left out (the same work per token). Its text is noise; its speed is its shape's."""
from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import click
import numpy as np

# GGUF architecture names of the transformers model types written here (dense decoders)
GGUF_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3_text": "gemma3"}
FILE_TYPES = {"q4_k_m": 15, "q8_0": 7}  # llama.cpp's LLAMA_FTYPE_MOSTLY_* (general.file_type)
POOL_BYTES = 64 << 20
CHUNK_BYTES = 256 << 20  # a tensor is made and written this much at a time: bounded memory
WEIGHT_STD = 0.02


@dataclass(frozen=True)
class Planned:
    name: str
    shape: tuple[int, ...]  # numpy order: (rows, columns) of a matrix, (n,) of a norm
    kind: str               # f32, q4_k, q6_k, q8_0


def use_more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's choice of the layers whose attn_v and ffn_down get more bits in Q4_K_M."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def tensor_plan(fields: dict, file_type: str) -> list[Planned]:
    """Every tensor of the file with its type, in the order llama.cpp's converter writes them."""
    from gguf import MODEL_TENSOR, TENSOR_NAMES

    model_type = fields.get("model_type", "llama")
    hidden, inter, layers = fields["hidden_size"], fields["intermediate_size"], fields["num_hidden_layers"]
    heads = fields["num_attention_heads"]
    kv_heads = fields.get("num_key_value_heads") or heads
    head_dim = fields.get("head_dim") or hidden // heads
    vocab = fields["vocab_size"]
    tied = fields.get("tie_word_embeddings", model_type == "gemma3_text")
    q4 = file_type == "q4_k_m"

    def matrix(kind_q4: str) -> str:
        return kind_q4 if q4 else "q8_0"

    def name(tensor, bid=None) -> str:
        return TENSOR_NAMES[tensor].format(bid=bid) + ".weight"

    plan = [Planned(name(MODEL_TENSOR.TOKEN_EMBD), (vocab, hidden), matrix("q6_k" if tied else "q4_k"))]
    for i in range(layers):
        more = "q6_k" if use_more_bits(i, layers) else "q4_k"
        plan += [Planned(name(MODEL_TENSOR.ATTN_NORM, i), (hidden,), "f32"),
                 Planned(name(MODEL_TENSOR.ATTN_Q, i), (heads * head_dim, hidden), matrix("q4_k")),
                 Planned(name(MODEL_TENSOR.ATTN_K, i), (kv_heads * head_dim, hidden), matrix("q4_k")),
                 Planned(name(MODEL_TENSOR.ATTN_V, i), (kv_heads * head_dim, hidden), matrix(more)),
                 Planned(name(MODEL_TENSOR.ATTN_OUT, i), (hidden, heads * head_dim), matrix("q4_k"))]
        if model_type in ("qwen3", "gemma3_text"):
            plan += [Planned(name(MODEL_TENSOR.ATTN_Q_NORM, i), (head_dim,), "f32"),
                     Planned(name(MODEL_TENSOR.ATTN_K_NORM, i), (head_dim,), "f32")]
        if model_type == "gemma3_text":
            plan.append(Planned(name(MODEL_TENSOR.ATTN_POST_NORM, i), (hidden,), "f32"))
        plan += [Planned(name(MODEL_TENSOR.FFN_NORM, i), (hidden,), "f32"),
                 Planned(name(MODEL_TENSOR.FFN_GATE, i), (inter, hidden), matrix("q4_k")),
                 Planned(name(MODEL_TENSOR.FFN_UP, i), (inter, hidden), matrix("q4_k")),
                 Planned(name(MODEL_TENSOR.FFN_DOWN, i), (hidden, inter), matrix(more))]
        if model_type == "gemma3_text":
            plan.append(Planned(name(MODEL_TENSOR.FFN_POST_NORM, i), (hidden,), "f32"))
    plan.append(Planned(name(MODEL_TENSOR.OUTPUT_NORM), (hidden,), "f32"))
    if not tied:
        plan.append(Planned(name(MODEL_TENSOR.OUTPUT), (vocab, hidden), matrix("q6_k")))
    for p in plan:
        if p.kind != "f32" and p.shape[1] % BLOCKS[p.kind][0]:
            raise click.ClickException(f"{p.name}: rows of {p.shape[1]} weights are not whole {p.kind} blocks "
                                       f"of {BLOCKS[p.kind][0]}")
    return plan


# weights per block, bytes per block (ggml-common.h's block_q4_K, block_q6_K, block_q8_0)
BLOCKS = {"q4_k": (256, 144), "q6_k": (256, 210), "q8_0": (32, 34)}


def _scales(kind: str, blocks: np.ndarray, rng: np.random.Generator) -> None:
    """Set each block's scales (the rest stays random quants) so the weights spread about as
    WEIGHT_STD, all finite. Spreads from the quants' uniform distributions:
    q4_k: w = d*sc*q - dmin*m, sc, m in 0..63, q in 0..15: std 263 d with dmin = 7.5 d (mean 0);
    q6_k: w = d*sc*(q - 32), sc in -16..15 (set here), q in 0..63: std 171 d;
    q8_0: w = d*q, q in -128..127: std 73.9 d."""
    n = len(blocks)
    jitter = rng.uniform(0.8, 1.2, n)
    if kind == "q4_k":
        d = WEIGHT_STD / 263 * jitter
        blocks[:, 0:2] = d.astype(np.float16).view(np.uint8).reshape(n, 2)
        blocks[:, 2:4] = (7.5 * d).astype(np.float16).view(np.uint8).reshape(n, 2)
    elif kind == "q6_k":
        blocks[:, 192:208] = ((blocks[:, 192:208] & 31).astype(np.int16) - 16).astype(np.int8).view(np.uint8)
        blocks[:, 208:210] = (WEIGHT_STD / 171 * jitter).astype(np.float16).view(np.uint8).reshape(n, 2)
    else:
        blocks[:, 0:2] = (WEIGHT_STD / 73.9 * jitter).astype(np.float16).view(np.uint8).reshape(n, 2)


def _chunks(p: Planned, pool: np.ndarray, rng: np.random.Generator):
    """The tensor's bytes, CHUNK_BYTES (whole rows) at a time."""
    if p.kind == "f32":
        yield np.ones(p.shape, np.float32)
        return
    per_block, block_bytes = BLOCKS[p.kind]
    rows, cols = p.shape
    row_bytes = cols // per_block * block_bytes
    step = max(1, CHUNK_BYTES // row_bytes)
    for first in range(0, rows, step):
        count = min(step, rows - first)
        out = np.empty(count * row_bytes, np.uint8)
        start, filled = int(rng.integers(len(pool))), 0
        while filled < len(out):
            piece = pool[start:start + len(out) - filled]
            out[filled:filled + len(piece)] = piece
            filled, start = filled + len(piece), 0
        _scales(p.kind, out.reshape(-1, block_bytes), rng)
        yield out


def _metadata(writer, fields: dict, arch: str, file_type: str) -> None:
    heads = fields["num_attention_heads"]
    head_dim = fields.get("head_dim") or fields["hidden_size"] // heads
    writer.add_name(f"random {fields.get('name', arch)}")
    writer.add_context_length(fields.get("max_position_embeddings", 4096))
    writer.add_embedding_length(fields["hidden_size"])
    writer.add_block_count(fields["num_hidden_layers"])
    writer.add_feed_forward_length(fields["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(fields.get("num_key_value_heads") or heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(fields.get("rms_norm_eps", 1e-6))
    writer.add_vocab_size(fields["vocab_size"])
    writer.add_file_type(FILE_TYPES[file_type])
    rope = fields.get("rope_parameters") or {}
    if arch == "gemma3":
        writer.add_sliding_window(fields.get("sliding_window") or 1024)
        rope = rope.get("full_attention", {})
    writer.add_rope_freq_base(float(rope.get("rope_theta", 10000.0)))
    if rope.get("rope_type") in ("yarn", "linear"):
        from gguf import RopeScalingType

        writer.add_rope_scaling_type(RopeScalingType.YARN if rope["rope_type"] == "yarn" else RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(rope["factor"]))
        if "original_max_position_embeddings" in rope:
            writer.add_rope_scaling_orig_ctx_len(int(rope["original_max_position_embeddings"]))


def _tokenizer(writer, vocab: int) -> None:
    """The default model's BPE tokenizer (from its converted folder's tokenizer.json: reading the
    GGUF's 49K token strings took 12 s) with `vocab` entries: padded with unused tokens, or cut to
    its first `vocab` tokens and the merges among them."""
    import json

    from gguf import TokenType

    from triforce.model.default_model import default_model_dir

    folder = default_model_dir()
    saved = json.loads((folder / "tokenizer.json").read_text())
    ids = saved["model"]["vocab"]
    tokens = sorted(ids, key=ids.get)[:vocab]
    control = {t["content"] for t in saved["added_tokens"] if t.get("special")}
    merges = [m if isinstance(m, str) else " ".join(m) for m in saved["model"]["merges"]]
    if vocab < len(ids):
        kept = set(tokens)
        merges = [m for m in merges if all(part in kept for part in m.split(" ")) and m.replace(" ", "") in kept]
    config = json.loads((folder / "tokenizer_config.json").read_text())
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens + [f"<|unused_{i}|>" for i in range(vocab - len(tokens))])
    writer.add_token_types([int(TokenType.CONTROL if t in control else TokenType.NORMAL) for t in tokens]
                           + [int(TokenType.UNUSED)] * (vocab - len(tokens)))
    writer.add_token_merges(merges)
    writer.add_bos_token_id(ids[config["bos_token"]])
    writer.add_eos_token_id(ids[config["eos_token"]])
    writer.add_pad_token_id(ids[config["pad_token"]])
    writer.add_add_bos_token(False)
    writer.add_chat_template((folder / "chat_template.jinja").read_text())


def write_random_gguf(path: Path, fields: dict, file_type: str = "q4_k_m", seed: int = 0,
                      say=lambda line: None) -> dict:
    """Write the file; returns what was written (bytes, tensors by type, seconds)."""
    from gguf import GGMLQuantizationType, GGUFWriter

    if file_type not in FILE_TYPES:
        raise click.ClickException(f"unknown --type '{file_type}' (choose from {', '.join(FILE_TYPES)})")
    model_type = fields.get("model_type", "llama")
    if model_type not in GGUF_ARCH:
        raise click.ClickException(f"model type {model_type} is not written here (dense {', '.join(GGUF_ARCH)})")
    arch = GGUF_ARCH[model_type]
    plan = tensor_plan(fields, file_type)
    started = time.perf_counter()
    rng = np.random.default_rng(seed)
    pool = np.frombuffer(rng.bytes(POOL_BYTES), np.uint8)
    writer = GGUFWriter(str(path), arch)
    _metadata(writer, fields, arch, file_type)
    _tokenizer(writer, fields["vocab_size"])
    types = {"f32": GGMLQuantizationType.F32, "q4_k": GGMLQuantizationType.Q4_K,
             "q6_k": GGMLQuantizationType.Q6_K, "q8_0": GGMLQuantizationType.Q8_0}
    sizes = [_nbytes(p) for p in plan]
    for p, size in zip(plan, sizes):
        writer.add_tensor_info(p.name, p.shape, np.dtype(np.float32), size, raw_dtype=types[p.kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    total, done, said = sum(sizes), 0, time.perf_counter()
    fout = writer.fout[0]
    for p, size in zip(plan, sizes):
        writer.write_padding(fout, fout.tell())
        for chunk in _chunks(p, pool, rng):
            chunk.tofile(fout)
            done += chunk.nbytes
            if time.perf_counter() - said > 2:
                say(f"  {done / 1e9:.1f} of {total / 1e9:.1f} GB written")
                said = time.perf_counter()
        writer.write_padding(fout, size)
    writer.close()
    counts: dict[str, int] = {}
    for p in plan:
        counts[p.kind] = counts.get(p.kind, 0) + 1
    return {"path": str(path), "bytes": Path(path).stat().st_size, "tensors": counts, "architecture": arch,
            "file_type": file_type, "seconds": round(time.perf_counter() - started, 1)}


def _nbytes(p: Planned) -> int:
    if p.kind == "f32":
        return 4 * int(np.prod(p.shape))
    per_block, block_bytes = BLOCKS[p.kind]
    return p.shape[0] * p.shape[1] // per_block * block_bytes


@click.command()
@click.argument("out", type=click.Path(dir_okay=False))
@click.option("--arch", required=True, help="A named architecture (`triforce plan --help` lists them).")
@click.option("--type", "file_type", type=click.Choice(sorted(FILE_TYPES)), default="q4_k_m", show_default=True)
@click.option("--layers", type=int, default=None, help="Fewer layers than the architecture has (a small file).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="One JSON object: what was written.")
def main(out: str, arch: str, file_type: str, layers: int | None, seed: int, as_json: bool) -> None:
    """Write a random-weight GGUF file of ARCH to OUT (see the module docstring)."""
    from triforce.model.architectures import ARCHITECTURES, arch_name

    arch = arch_name(arch)
    fields = {"name": arch, **ARCHITECTURES[arch]}
    if layers is not None:
        if not 1 <= layers <= fields["num_hidden_layers"]:
            raise click.BadParameter(f"must be 1 to {fields['num_hidden_layers']}", param_hint="--layers")
        fields["num_hidden_layers"] = layers
        if "layer_types" in fields:
            fields["layer_types"] = fields["layer_types"][:layers]
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    written = write_random_gguf(Path(out), fields, file_type, seed, say=lambda line: print(line, file=sys.stderr))
    if as_json:
        print(json.dumps(written))
        return
    print(f"{written['path']}: {written['bytes'] / 1e9:.2f} GB, {arch} {file_type}, tensors {written['tensors']}, "
          f"{written['seconds']} s")


if __name__ == "__main__":
    main()
