"""Resolve `--model` (default | HF folder | .gguf file) and load model plus tokenizer."""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch

from triforce.config.model import ModelConfig
from triforce.errors import DamagedFileError, UserError
from triforce.kernels import SDPA, SdpaAttention
from triforce.model.context_stretch import stretch
from triforce.model.decoder import CausalLM
from triforce.model.gguf_weights import GgufSource
from triforce.model.hf_config import generation_eos, read_hf_config
from triforce.model.rope import layer_ropes
from triforce.model.sampling_defaults import read_sampling_defaults
from triforce.model.weights import check_layer_count, iter_tensors, load_into, weight_files
from triforce.paths import cache_root, shown

DTYPES = {"float32": torch.float32, "float64": torch.float64,
          "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    model: CausalLM
    tokenizer: object
    path: Path
    dtype: torch.dtype
    device: torch.device
    eos_ids: frozenset[int]  # generation stops at any of these
    attn: SdpaAttention = SDPA  # attention backend every cache of this model uses (--attn)
    quantized: dict | None = None  # what --quantize made of the weights (triforce.model.quantized)
    sampling_defaults: object = None  # the model's own (triforce.model.sampling_defaults.ModelSampling)

    @property
    def config(self) -> ModelConfig:
        return self.model.config


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """auto: bfloat16 on CUDA and on CPUs with native bfloat16 (see triforce.model.cpu_features)."""
    if name == "auto":
        from triforce.model import cpu_features
        native = device.type == "cuda" or cpu_features.native_bf16()
        return torch.bfloat16 if native else torch.float32
    if name not in DTYPES:
        raise UserError(f"unknown dtype '{name}' (choose from auto, {', '.join(DTYPES)})")
    return DTYPES[name]


def resolve_device(name: str) -> torch.device:
    """`--device` -> the one device value the runtime passes around: cpu, or cuda with its index
    always set (auto and cuda mean the current card). Several torch.cuda functions refuse an
    index-less cuda device (get_per_process_memory_fraction, set_device), so none reaches them.
    Other names torch knows (mps, xla, meta) this build cannot run or hold no data."""
    import re

    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    match = re.fullmatch(r"(cpu|cuda)(?::(\d{1,4}))?", name)
    if match is None or (match.group(1) == "cpu" and match.group(2) is not None):
        raise UserError(f"unknown device '{name}' (use auto, cpu, cuda or cuda:N)")
    if match.group(1) == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        if torch.version.cuda is None:  # the CPU build: no driver or card would help
            raise UserError(f"--device {name}: this torch ({torch.__version__}) is the CPU-only build; install a CUDA "
                            "build (https://pytorch.org/get-started/locally/) to use a GPU")
        raise UserError(f"--device {name} was asked for but no CUDA device is available (torch "
                        f"{torch.__version__}, CUDA {torch.version.cuda}: is the driver loaded and a card visible?)")
    count = torch.cuda.device_count()
    index = int(match.group(2)) if match.group(2) is not None else torch.cuda.current_device()
    if index >= count:
        raise UserError(f"--device {name}: this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}")
    return torch.device("cuda", index)


def resolve_model_dir(spec: str) -> Path:
    """A Hugging Face folder with config.json for `spec`, converting GGUF files once."""
    from triforce.model.default_model import default_model_dir

    if spec == "default":
        return default_model_dir()
    try:
        return _model_dir(spec)
    except OSError as e:  # a name too long for a path, a folder it may not read, a file used as a folder
        raise UserError(f"cannot use model '{shown(spec)}': {e.strerror or e}") from None


def _model_dir(spec: str) -> Path:
    from triforce.model.gguf_convert import convert_gguf, converted_dir_for

    path = _located(spec)
    if not path.exists():
        raise UserError(f"model path '{shown(spec)}' does not exist (give a local Hugging Face folder, a .gguf file, "
                        "ORG/NAME from the Hugging Face cache, ollama:NAME[:TAG], or 'default'; `triforce models` "
                        "lists what runs here; triforce never downloads from a hub)")
    if path.is_dir() and (path / "config.json").exists():
        return path
    ggufs = _ggufs_at(path)
    if len(ggufs) == 1:
        return convert_gguf(ggufs[0], converted_dir_for(ggufs[0]))
    if len(ggufs) > 1:
        raise UserError(f"{path} holds several .gguf files; name one of them")
    raise UserError(f"'{shown(spec)}' is neither a Hugging Face model folder (no config.json) nor a .gguf file")


def model_shape(spec: str) -> tuple[ModelConfig, Path]:
    """The shape of the model `spec` names (as load_model takes it), read from its config alone,
    and its folder."""
    folder = resolve_model_dir(spec)
    return ModelConfig.from_hf(read_hf_config(folder)), folder


def build_model(hf_config, files: list[Path], dtype: torch.dtype, device: torch.device,
                shard: tuple[int, int] | None = None, context: int | None = None,
                blocks: frozenset[str] = frozenset()) -> CausalLM:
    """shard (rank, world): build rank's tensor-parallel share and slice each checkpoint tensor
    on the host, so a model that needs two cards never has to fit on one. context: the model's
    context when it differs from the config's (a stretched one, see triforce.model.context_stretch).
    blocks: parameters left on the meta device for the file's blocks (triforce.model.quantized),
    the kernels built once they are in."""
    cfg = ModelConfig.from_hf(hf_config)
    if context is not None:
        cfg = replace(cfg, max_position_embeddings=context)
    ropes = layer_ropes(hf_config, cfg.num_layers)  # outside the meta context: they hold real frequencies
    with torch.device("meta"):
        model = CausalLM(cfg, ropes)
    slicer = None
    if shard is not None:
        from triforce.model.tensor_parallel import shard_slicer
        from triforce.model.tensor_parallel import shard_meta_model

        shard_meta_model(model, *shard)
        slicer = shard_slicer(cfg, *shard)
    if device.type == "cpu":
        from triforce.model.host_memory import check_host_room, meta_model_bytes
        check_host_room(meta_model_bytes(model, dtype), f"the model in {str(dtype).removeprefix('torch.')}",
                        "--dtype bfloat16, or a smaller model")
    load_into(model, files, dtype, device, slicer, skip=blocks, checkpoint=cfg)
    if not blocks:
        model.use_kernels("fused")
    return model.eval()


def load_model(spec: str, *, dtype: str = "auto", device: str = "auto",
               shard: tuple[int, int] | None = None, rope_scaling: tuple[int, str] | None = None,
               quantize: str | None = None, quantize_required: bool = True) -> LoadedModel:
    """rope_scaling (context, kind): stretch the model's RoPE to that context (--rope-scaling).
    quantize: run the projections as GGUF blocks (triforce.model.quantized; on a GPU the model is
    loaded and quantized on the CPU, then moved; one process only so far);
    quantize_required False: floats where the file holds no tensor in a format run as blocks."""
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    if quantize is not None and shard is not None:
        raise UserError("--quantize runs on one process so far (no tensor parallelism for block weights yet)")
    build_on = torch.device("cpu") if quantize is not None else torch_device  # blocks are made on the CPU
    folder = resolve_model_dir(spec)
    try:
        source = GgufSource.read(folder)  # a converted GGUF: weights read from the file
        hf_config, context = read_hf_config(folder), None
        if rope_scaling is not None:
            hf_config, context = stretch(hf_config, *rope_scaling)
        blocks = frozenset()
        if quantize == "gguf" and source is not None:  # never made float
            from triforce.model.quantized import block_parameters
            blocks = block_parameters(source, hf_config.num_hidden_layers)
        files = weight_files(folder)
        check_layer_count(hf_config.num_hidden_layers, files)
        model = build_model(hf_config, files, torch_dtype, build_on, shard, context, blocks)
        tokenizer = load_tokenizer(folder)
    except DamagedFileError as e:
        if cache_root().resolve() in folder.resolve().parents:  # damage the size check cannot see
            raise DamagedFileError(f"{e} -- a damaged cache entry: delete {folder} and it is rebuilt") from None
        raise
    eos_ids = _eos_ids(generation_eos(folder, hf_config), tokenizer.eos_token_id)
    quantized = None
    if quantize is not None:
        from triforce.model.quantized import quantize_model
        quantized = quantize_model(model, quantize, gguf_file(spec) if quantize == "gguf" else None,
                                   required=quantize_required, device=torch_device,
                                   row_order=None if source is None else source.row_order,
                                   architecture="llama" if source is None else source.architecture)
        if quantized is None and build_on != torch_device:  # a file without blocks stays float: move it
            model.to(torch_device)
            model.use_kernels("fused")
    return LoadedModel(model, tokenizer, folder, torch_dtype, torch_device, eos_ids, quantized=quantized,
                       sampling_defaults=read_sampling_defaults(folder))


def gguf_file(spec: str) -> Path | None:
    """The .gguf file `--model spec` names (None for a folder, a converted one included)."""
    if spec == "default":
        from triforce.model.default_model import ensure_gguf
        return ensure_gguf()
    try:
        path = _located(spec)
        ggufs = _ggufs_at(path)
        return ggufs[0] if len(ggufs) == 1 and not (path.is_dir() and (path / "config.json").exists()) else None
    except OSError as e:
        raise UserError(f"cannot use model '{shown(spec)}': {e.strerror or e}") from None


def _located(spec: str) -> Path:
    """`--model`'s path: a name (ORG/NAME, ollama:NAME) looked up offline, else the path given."""
    from triforce.model.model_names import locate

    return locate(spec) or Path(spec).expanduser()


def _ggufs_at(path: Path) -> list[Path]:
    """The GGUF file `path` is, or the .gguf files in the folder it is."""
    from triforce.model.model_names import is_gguf

    return [path] if path.is_file() and is_gguf(path) else sorted(path.glob("*.gguf")) if path.is_dir() else []


def _eos_ids(*sources) -> frozenset[int]:
    ids: set[int] = set()
    for source in sources:
        if isinstance(source, int):
            ids.add(source)
        elif source:
            ids.update(source)
    return frozenset(ids)


def transformers_model(folder: Path, dtype: torch.dtype):
    """transformers' own model of a folder, for comparisons: from_pretrained, or for a converted
    GGUF its config with the weights read from the file (what transformers' GGUF loader makes of
    them, bit for bit: tests/unit/test_gguf_in_place.py)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if GgufSource.read(folder) is None:
        return AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype).eval()
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(folder)), dtype=dtype)
    state = {name: tensor.to(dtype) for path in weight_files(folder) for name, tensor in iter_tensors(path)}
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    if unexpected or set(missing) - tied:
        raise UserError(f"{folder}: weights do not fit transformers' model (missing {sorted(set(missing) - tied)[:3]}, "
                        f"unexpected {unexpected[:3]})")
    model.tie_weights()
    return model.eval()


def load_tokenizer(folder: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(folder))
    except Exception as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise DamagedFileError(f"cannot load the tokenizer from {folder}: {msg}") from None
