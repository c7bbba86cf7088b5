"""Turn a GGUF file into a cached Hugging Face folder: config, tokenizer and a record naming the
file (triforce.model.gguf_weights), which the weights are read from at each load.

The file's header is checked first (readable, a supported architecture, every decoder tensor
present), so nothing wrong is ever cached; no float copy of the weights is written."""
from __future__ import annotations

import hashlib
import shutil
import sys
import tempfile
import time
from functools import cache
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from triforce.errors import UserError
from triforce.model.cache_entry import building, cache_error, damage, partial_prefix, record_sizes, remove
from triforce.paths import cache_root

GGUF_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma3", "phi3")  # GGUF names of the decoders triforce runs
_METADATA_BYTES = 64 << 20  # room for a tokenizer and config, with a margin


@cache
def conversion_digest() -> str:
    """A digest of what decides a converted folder's contents: this module and the sampling
    defaults' (the configs llama.cpp's way, the file's sampling fields) and the versions of the
    readers they call (transformers, gguf). A folder another one wrote is converted again: an
    older triforce's Qwen3 config, say, held the wrong head dimension."""
    from triforce.model import sampling_defaults

    digest = hashlib.sha256()
    for module in (Path(__file__), Path(sampling_defaults.__file__)):
        digest.update(module.read_bytes())
    for package in ("transformers", "gguf"):
        try:
            digest.update(f"|{package} {version(package)}".encode())
        except PackageNotFoundError:
            digest.update(f"|{package} none".encode())
    return digest.hexdigest()[:16]


def converted_dir_for(gguf_path: Path) -> Path:
    stat = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|in-place".encode()).hexdigest()
    return cache_root() / "converted" / f"{gguf_path.stem}-{key[:12]}"


def convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """The converted folder `out_dir`, built once (see triforce.model.cache_entry) and rebuilt
    when it is found damaged or stale (an older triforce's float copy, or made from another file)."""
    if out_dir.exists() and _stale(out_dir, gguf_path) is None:
        return out_dir
    architecture = _check_header(gguf_path)
    try:
        with building(out_dir, f"the conversion of {gguf_path.name}"):
            if out_dir.exists():  # another process may have finished it while we waited
                problem = _stale(out_dir, gguf_path)
                if problem is None:
                    return out_dir
                print(f"the cached model {out_dir} {problem}; converting it again", file=sys.stderr)
                remove(out_dir)
            free = shutil.disk_usage(out_dir.parent).free
            if free < _METADATA_BYTES:
                raise UserError(f"reading {gguf_path.name}'s tokenizer and config needs about "
                                f"{_METADATA_BYTES / 1e9:.2f} GB in the cache folder {cache_root()} but "
                                f"{free / 1e9:.2f} GB are free (set TRIFORCE_CACHE to a folder with room)")
            print(f"reading {gguf_path.name}'s tokenizer and config (one time; cached in {out_dir}; the weights "
                  "stay in the file)", file=sys.stderr)
            tmp = Path(tempfile.mkdtemp(prefix=partial_prefix(out_dir), dir=out_dir.parent))
            try:
                _convert_into(gguf_path, tmp, architecture)
                record_sizes(tmp)
                tmp.rename(out_dir)
            finally:
                remove(tmp)
    except OSError as e:
        raise cache_error(e, f"the conversion of {gguf_path.name}") from None
    return out_dir


def _convert_into(gguf_path: Path, folder: Path, architecture: str) -> None:
    from gguf import GGUFReader
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    from triforce.model.gguf_weights import GgufSource
    from triforce.model.sampling_defaults import gguf_generation_fields

    where, name = str(gguf_path.parent), gguf_path.name
    started = time.perf_counter()
    try:
        _say("  1/2 reading the tokenizer from the file")
        tokenizer = AutoTokenizer.from_pretrained(where, gguf_file=name)
        _say(f"  2/2 reading the config ({time.perf_counter() - started:.0f} s so far)")
        config = AutoConfig.from_pretrained(where, gguf_file=name)
    except Exception as e:
        raise _unreadable(gguf_path, e) from None
    config.quantization_config = None  # weights reach the model as blocks or de-quantized floats
    del config.quantization_config
    reader = GGUFReader(str(gguf_path))
    if architecture in _AS_LLAMA_CPP_READS:
        _AS_LLAMA_CPP_READS[architecture](config, reader)
    config.save_pretrained(folder)
    generation = GenerationConfig.from_model_config(config)
    for name, value in gguf_generation_fields(reader).items():  # the file's sampling defaults, if it has any
        setattr(generation, name, value)
    generation.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    GgufSource.of(gguf_path, architecture, heads, kv_heads, conversion_digest()).write(folder)


def _metadata(reader, architecture: str):
    """value(key, default): the file's `architecture.key` field, or the default where it has none."""
    def value(key, default=None):
        field = reader.fields.get(f"{architecture}.{key}")
        return default if field is None else field.contents()
    return value


def _gemma3_as_llama_cpp_reads_it(config, reader) -> None:
    """What transformers' GGUF reader leaves out of a Gemma 3 config, read as llama.cpp reads the
    file (src/models/gemma3.cpp): which layers are windowed (the file's pattern, else every sixth
    global), the global layers' linear RoPE scaling and the local ones' base, and the query scale
    (1/sqrt(hidden / heads) for its 62-layer 27B, else 1/sqrt(head_dim): the file does not say)."""
    value = _metadata(reader, "gemma3")
    layers, window = config.num_hidden_layers, value("attention.sliding_window")
    pattern = value("attention.sliding_window_pattern", 6)
    windowed = (list(pattern) if isinstance(pattern, list) else [i % pattern < pattern - 1 for i in range(layers)]) \
        if window else [False] * layers
    config.sliding_window = window
    config.layer_types = ["sliding_attention" if w else "full_attention" for w in windowed]
    full = {"rope_type": "default", "rope_theta": float(value("rope.freq_base", 1_000_000.0))}
    if value("rope.scaling.type") == "linear":
        full.update(rope_type="linear", factor=float(value("rope.scaling.factor")))
    config.rope_parameters = {"full_attention": full, "sliding_attention": {
        "rope_type": "default", "rope_theta": float(value("rope.freq_base_swa", 10_000.0))}}
    head_dim = value("attention.key_length") or config.hidden_size // config.num_attention_heads
    config.head_dim = head_dim
    config.query_pre_attn_scalar = config.hidden_size // config.num_attention_heads if layers == 62 else head_dim
    config.final_logit_softcapping = value("final_logit_softcapping")


def _qwen3_as_llama_cpp_reads_it(config, reader) -> None:
    """transformers' GGUF reader leaves a Qwen3's head dimension at its config's default (128)
    whatever the file says: llama.cpp reads it from attention.key_length (a 64-wide head's q_norm
    then failed to load: bench/random_gguf.py's qwen3-tiny-test)."""
    head_dim = _metadata(reader, "qwen3")("attention.key_length")
    if head_dim:
        config.head_dim = int(head_dim)


def _phi3_as_llama_cpp_reads_it(config, reader) -> None:
    """What transformers' GGUF reader leaves out of a Phi-3 config: the window (0: none, as
    Phi-4's files say), partial rotary (the rotary dims against the head's), and LongRoPE, whose
    factors the file holds as the tensors rope_factors_long and rope_factors_short."""
    import numpy as np

    value = _metadata(reader, "phi3")
    head_dim = config.hidden_size // config.num_attention_heads
    params = {"rope_type": "default", "rope_theta": float(value("rope.freq_base", 10_000.0)),
              "partial_rotary_factor": value("rope.dimension_count", head_dim) / head_dim}
    factors = {t.name: [float(x) for x in np.asarray(t.data)] for t in reader.tensors if t.name.startswith("rope_factors_")}
    if factors:
        params.update(rope_type="longrope", long_factor=factors["rope_factors_long.weight"],
                      short_factor=factors["rope_factors_short.weight"],
                      original_max_position_embeddings=int(value("rope.scaling.original_context_length")))
        if value("rope.scaling.attn_factor") is not None:
            params["attention_factor"] = float(value("rope.scaling.attn_factor"))
        config.original_max_position_embeddings = params["original_max_position_embeddings"]  # transformers reads it here
    config.rope_parameters = params
    config.sliding_window = value("attention.sliding_window") or None


# architectures whose config transformers' GGUF reader leaves incomplete
_AS_LLAMA_CPP_READS = {"gemma3": _gemma3_as_llama_cpp_reads_it, "phi3": _phi3_as_llama_cpp_reads_it,
                       "qwen3": _qwen3_as_llama_cpp_reads_it}


def _stale(folder: Path, gguf_path: Path) -> str | None:
    """Why the converted `folder` cannot serve `gguf_path` (None: it can)."""
    from triforce.model.gguf_weights import GgufSource

    problem = damage(folder)
    if problem is not None:
        return f"is damaged ({problem})"
    try:
        source = GgufSource.read(folder)
    except UserError as e:
        return f"is damaged ({e})"
    if source is None:
        return "is an older triforce's float32 copy (the weights are now read from the file)"
    if source.path != gguf_path.resolve() or source.changed() is not None:
        return f"was made from {source.path} as it was then"
    if source.made_by != conversion_digest():
        return "was made by another version of triforce's GGUF reading (or of transformers or gguf)"
    return None


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _unreadable(gguf_path: Path, error: Exception) -> UserError:
    msg = str(error).splitlines()[0] if str(error) else type(error).__name__
    return UserError(f"cannot read GGUF file {gguf_path} (corrupt, truncated or unsupported?): {msg}")


def _check_header(gguf_path: Path) -> str:
    """Parse the header and tensor table (memory-mapped, cheap) before any slow work: the
    architecture must be one triforce runs. Returns it."""
    from gguf import GGUFReader
    try:
        reader = GGUFReader(str(gguf_path))
        field = reader.fields.get("general.architecture")
        arch = field.contents() if field is not None else None
    except Exception as e:
        raise _unreadable(gguf_path, e) from None
    if arch not in GGUF_ARCHITECTURES:
        raise UserError(f"GGUF file {gguf_path} holds a '{arch}' model; triforce runs "
                        f"{', '.join(GGUF_ARCHITECTURES)} from GGUF files (nothing was converted)")
    missing = _missing_tensors(reader, arch)
    if missing:
        raise UserError(f"GGUF file {gguf_path} lacks {len(missing)} tensor(s) the model needs, e.g. "
                        f"'{missing[0]}' (an incomplete or edited file); nothing was converted or cached")
    return arch


def _missing_tensors(reader, arch: str) -> list[str]:
    """The decoder weights a dense llama-like GGUF must hold (names from gguf's own tables),
    checked from the header so an incomplete file is refused in a second, not after the
    conversion; anything subtler (a bias) is still caught when the conversion loads it."""
    from gguf import MODEL_TENSOR, TENSOR_NAMES

    block_field = reader.fields.get(f"{arch}.block_count")
    blocks = int(block_field.contents()) if block_field is not None else 0
    per_block = (MODEL_TENSOR.ATTN_NORM, MODEL_TENSOR.ATTN_Q, MODEL_TENSOR.ATTN_K, MODEL_TENSOR.ATTN_V,
                 MODEL_TENSOR.ATTN_OUT, MODEL_TENSOR.FFN_NORM, MODEL_TENSOR.FFN_GATE, MODEL_TENSOR.FFN_UP,
                 MODEL_TENSOR.FFN_DOWN)
    if arch == "phi3":  # q, k, v in one matrix, gate and up in another
        per_block = (MODEL_TENSOR.ATTN_NORM, MODEL_TENSOR.ATTN_QKV, MODEL_TENSOR.ATTN_OUT, MODEL_TENSOR.FFN_NORM,
                     MODEL_TENSOR.FFN_UP, MODEL_TENSOR.FFN_DOWN)
    if blocks * len(per_block) > len(reader.tensors):  # refused before a name is made for each
        raise UserError(f"GGUF file {reader.data.filename} claims {blocks:,} layers but holds only "
                        f"{len(reader.tensors):,} tensors (a layer takes {len(per_block)}): its metadata is "
                        "wrong; nothing was converted")
    needed = [TENSOR_NAMES[MODEL_TENSOR.TOKEN_EMBD], TENSOR_NAMES[MODEL_TENSOR.OUTPUT_NORM]]
    needed += [TENSOR_NAMES[t].format(bid=b) for b in range(blocks) for t in per_block]
    present = {t.name for t in reader.tensors}
    return [f"{name}.weight" for name in needed if f"{name}.weight" not in present]
