"""Flags shared by several commands, and turning them into config objects."""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import click

from triforce.config import CHAT_SAMPLING, SEED_MAX, SEED_MIN, SamplingParams, build_spec
from triforce.errors import UserError


class FiniteFloat(click.ParamType):
    """A float flag: 'nan' and 'inf' parse as floats but mean nothing as a temperature or a depth.
    low/high: the range a value must lie in (open at the low end when low_open), refused here
    with a flag error (exit 2) like any other bad value."""
    name = "number"

    def __init__(self, low: float | None = None, high: float | None = None, low_open: bool = False):
        self.low, self.high, self.low_open = low, high, low_open

    def convert(self, value, param, ctx):
        number = click.FLOAT.convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        below = self.low is not None and (number <= self.low if self.low_open else number < self.low)
        if below or (self.high is not None and number > self.high):
            bounds = f"{'(' if self.low_open else '['}{self.low}, {self.high if self.high is not None else 'inf'}"
            self.fail(f"{number:g} is outside {bounds}{']' if self.high is not None else ')'}", param, ctx)
        return number


SUFFIXES = {"k": 1 << 10, "m": 1 << 20}  # 128K = 131072 tokens, as model cards and llama.cpp count them


def count_of(text: str) -> int:
    """'131072', '128K' or '128k' (x 1024), '1M' (x 1048576) -> an int; ValueError otherwise."""
    text = text.strip()
    unit = SUFFIXES.get(text[-1:].lower())
    return int(text[:-1]) * unit if unit and text[:-1].strip().lstrip("-").isdigit() else int(text)


class BoundedInt(click.ParamType):
    """An integer flag bounded so that a huge value is one error line here rather than an overflow
    deep inside torch; unlike click.IntRange, the bounds stay out of --help, where they are noise.
    Counts take K and M (x 1024, x 1048576): `--context 128K`."""
    name = "integer"

    def __init__(self, low: int, high: int):
        self.low, self.high = low, high

    def convert(self, value, param, ctx):
        if isinstance(value, str) and value.strip()[-1:].lower() in SUFFIXES:
            try:
                value = count_of(value)
            except ValueError:
                self.fail(f"'{value}' is not a valid integer (a count may end in K or M: 128K)", param, ctx)
        number = click.INT.convert(value, param, ctx)
        if not self.low <= number <= self.high:
            self.fail(f"{number} is out of range ({self.low} to {self.high})", param, ctx)
        return number


INT = BoundedInt(-2**31, 2**31 - 1)  # token counts, sizes and ranks
SEED = BoundedInt(SEED_MIN, SEED_MAX)
FLOAT = FiniteFloat()

# how every --model reads a name (triforce.model.model_names)
MODEL_FORMS = ("a folder, a .gguf file, ORG/NAME (a Hugging Face model in the local cache), ollama:NAME (a model "
               "Ollama pulled) or 'default' (SmolLM2-135M-Instruct)")
model_option = click.option("--model", "model", default="default", show_default=True,
                            help=f"The model: {MODEL_FORMS}.")
dtype_option = click.option("--dtype", type=click.Choice(["auto", "float32", "float64", "bfloat16", "float16"]),
                            default="auto", show_default=True,
                            help="Weights and KV precision; auto = bfloat16 on CUDA and on CPUs with native bfloat16 "
                                 "(AVX512_BF16, AMX, Arm BF16), float32 elsewhere. Greedy tokens equal plain "
                                 "decoding exactly in float32/float64.")
quantize_option = click.option("--quantize", type=click.Choice(["auto", "gguf", "q8_0", "q4_0", "q4_1", "q4_k",
                                                                "none"]),
                               default="auto", show_default=True,
                               help="Run the projections as GGUF blocks (numba kernels on a CPU, Triton on a "
                                    "GPU): gguf = the .gguf file's own "
                                    "(the default model's Q4_1, embeddings Q8_0; Q8_0/Q4_0/Q4_1/Q4_K/Q6_K tensors run "
                                    "as blocks, others such as Q5_0 stay float), q8_0/q4_0/q4_1/q4_k = quantized "
                                    "at load (q4_k rows not a multiple of 256 as q4_1; an --arch gets random "
                                    "blocks), none = de-quantized floats. auto = gguf for a .gguf model (the default "
                                    "one too) on a CPU with FMA when --dtype is auto, else none. Greedy tokens of "
                                    "every method equal ar's over the same blocks; --dtype sets the activations and KV.")
device_option = click.option("--device", default="auto", show_default=True,
                             help="cpu, cuda or cuda:N; auto picks CUDA when present. auto and cuda mean the "
                                  "current card (cuda:0 unless CUDA_VISIBLE_DEVICES or torch says otherwise).")


threads_option = click.option("--threads", type=BoundedInt(1, 4096), default=None,
                              help="CPU threads of the kernels (default: the cores this process may use). Fewer "
                                   "leave cores to other programs; decoding on a shared machine keeps its pace.")


MODEL_DEFAULT = ("temperature", "top_p", "top_k", "repeat_penalty")  # the flags a model's defaults may set


@dataclass(frozen=True)
class SamplingFlags:
    """The sampling flags as given (a model-default flag left out: the model's own default), checked."""
    given: dict

    def over(self, defaults: SamplingParams) -> SamplingParams:
        return replace(defaults, **self.given)

    @property
    def sets_model_defaults(self) -> bool:
        return any(name in self.given for name in MODEL_DEFAULT)


SAMPLING_FLAGS = ("temperature", "top_p", "top_k", "seed", "repeat_penalty", "presence_penalty", "frequency_penalty",
                  "penalty_last_n")


def sampling_of(flags: dict, defaults: SamplingParams | None) -> SamplingParams | SamplingFlags:
    """The sampling flags (taken out of a command's `flags`, as sampling_options added them) as a
    SamplingParams (checked) with `defaults`' values where a flag is not given; defaults None: a
    SamplingFlags, laid over the model's own defaults once it is loaded
    (triforce.model.sampling_defaults)."""
    values = {name: flags.pop(name) for name in SAMPLING_FLAGS}
    given = {k: v for k, v in values.items() if v is not None or k not in MODEL_DEFAULT}
    sampling = replace(CHAT_SAMPLING if defaults is None else defaults, **given)  # checked now
    return SamplingFlags(given) if defaults is None else sampling


def sampling_options(defaults: SamplingParams | None):
    """The sampling flags (sampling_of turns them into one SamplingParams or SamplingFlags):
    `defaults` shown in --help; None: the model's own defaults."""
    model = defaults is None
    shown = SamplingParams() if model else defaults

    def default_help(value) -> str:
        return " Default: the model's (its generation_config.json), else triforce's chat default " \
               f"({value:g})." if model else ""

    def decorate(command):
        command = click.option("--penalty-last-n", type=INT, default=64, show_default=True,
                               help="The context tokens (prompt included) the three penalties look at.")(command)
        command = click.option("--frequency-penalty", type=FiniteFloat(-2.0, 2.0), default=0.0, show_default=True,
                               help="Subtracted from a token's logit per occurrence (OpenAI's).")(command)
        command = click.option("--presence-penalty", type=FiniteFloat(-2.0, 2.0), default=0.0, show_default=True,
                               help="Subtracted once from the logit of a token that occurs (OpenAI's).")(command)
        command = click.option("--repeat-penalty", type=FiniteFloat(0.0, 10.0, low_open=True),
                               default=None if model else shown.repeat_penalty, show_default=not model,
                               help="A token that occurs has its logit divided by this when positive, multiplied "
                                    "when negative (llama.cpp's; 1 = off). Every method applies it exactly."
                                    + default_help(CHAT_SAMPLING.repeat_penalty))(command)
        command = click.option("--seed", type=SEED, default=None, help="Random seed for reproducible sampling.")(command)
        command = click.option("--top-k", type=INT, default=None if model else shown.top_k, show_default=not model,
                               help="Keep only the k most likely tokens (0 = off)."
                                    + default_help(CHAT_SAMPLING.top_k))(command)
        command = click.option("--top-p", type=FiniteFloat(0.0, 1.0, low_open=True),
                               default=None if model else shown.top_p, show_default=not model,
                               help="Nucleus sampling mass, in (0, 1]." + default_help(CHAT_SAMPLING.top_p))(command)
        return click.option("--temperature", type=FiniteFloat(0.0), default=None if model else shown.temperature,
                            show_default=not model,
                            help="0 = greedy (argmax)." + default_help(CHAT_SAMPLING.temperature))(command)
    return decorate


def check_output_path(flag: str, path: str | None) -> None:
    """An output file the run will write at its end: refuse it now, before any work, if it
    cannot be written (a folder, a missing or read-only parent, a read-only file)."""
    if path is None:
        return
    import os
    from pathlib import Path

    target = Path(path).expanduser()
    parent = target.parent if str(target.parent) else Path(".")
    if target.is_dir():
        raise UserError(f"{flag} {path} is a directory; give a file path")
    if not parent.is_dir():
        raise UserError(f"{flag} {path}: the folder {parent} does not exist")
    if not os.access(target if target.exists() else parent, os.W_OK):
        raise UserError(f"{flag} {path} cannot be written (permission denied)")


def check_non_negative(name: str, value: int) -> None:
    if value < 0:
        raise UserError(f"{name} must be >= 0, got {value}")


def speculation_options(default_method: str):
    """--method, --draft and the speculation parameters (see SpecParams)."""
    from triforce.config import AUTO, METHODS, SpecParams

    d = SpecParams()

    def decorate(f):
        opts = [
            click.option("--method", type=click.Choice(METHODS + (AUTO,)), default=default_method,
                         show_default=True,
                         help="ar: plain decoding; triforce: draft -> retrieval cache -> full cache; "
                              "retrieval: retrieval -> full; streaming: StreamingLLM cache -> full; "
                              "snapkv: SnapKV cache (what the last 32 tokens attend to most) -> full, "
                              "needs the whole KV on the device; naive: draft -> full; auto: the cost model picks ar, naive, retrieval or "
                              "triforce for this context and profile (and decodes as ar until the sequence "
                              "is long enough for speculation to pay); the choice is printed."),
            click.option("--draft", default=None,
                         help="Tier-0 drafter: a model path (same tokenizer as the target), 'lookup' "
                              "(prompt n-gram lookup, the default) or 'none' (triforce with two tiers)."),
            click.option("--budget", type=INT, default=None,
                         help=f"Tokens in the retrieval / streaming cache (default: chosen by the cost model "
                              f"from the profile's measured acceptance, else {d.budget})."),
            click.option("--chunk-size", type=INT, default=None,
                         help=f"Retrieval chunk size in tokens (default: chosen with the budget, else {d.chunk_size})."),
            click.option("--gamma1", type=INT, default=None,
                         help=f"Tier-0 drafts per retrieval-tier check (triforce; default: chosen by the cost "
                              f"model, else {d.gamma1}, and lowered, to none, while they are mostly refused where "
                              "a wider check costs more, as on a CPU; a value given here is kept)."),
            click.option("--gamma2", type=INT, default=None,
                         help="Tokens proposed to each full-cache verify (default: chosen by the cost model "
                              "and adapted to the acceptance seen while generating; a value given here is kept)."),
            click.option("--rebuild-stride", type=INT, default=d.rebuild_stride, show_default=True,
                         help="Rebuild the retrieval cache every N generated tokens."),
            click.option("--rebuild-threshold", type=FLOAT, default=d.rebuild_threshold, show_default=True,
                         help="Rebuild sooner when the full tier's rolling acceptance falls below this."),
        ]
        for opt in reversed(opts):
            f = opt(f)
        return f
    return decorate


def offload_options(f):
    """--profile and --device-budget: where the KV cache lives (see `triforce plan`)."""
    f = click.option("--device-budget", default=None,
                     help="Bytes the plan may use on each device, e.g. 600MB or 20GiB (replaces the "
                          "profile's gpu_bytes minus reserved_bytes; MB = 10^6, MiB = 2^20).")(f)
    f = click.option("--profile", default=None,
                     help="Memory profile: a name from `triforce profile list` or a .toml file "
                          "(default: on a CPU the cpu profile's rates with this machine's memory and cores, "
                          "`--profile cpu` being the shipped 16 GiB reference; on CUDA the detected card).")(f)
    return f


def runtime_options(count_syncs: bool = True):
    """--attn, --no-graphs and --threads (and --count-syncs where a summary reports it)."""
    def decorate(f):
        f = threads_option(f)
        if count_syncs:
            f = click.option("--count-syncs", is_flag=True,
                             help="Count the host synchronisations of each decoding phase (CUDA; a debug aid "
                                  "that slows decoding) and report them in the summary.")(f)
        f = click.option("--no-graphs", is_flag=True,
                         help="Run every tier eagerly instead of replaying CUDA graphs (CUDA only; "
                              "the tokens are the same either way).")(f)
        f = click.option("--attn", type=click.Choice(["auto", "flash", "sdpa", "sdpa-reference"]), default="auto",
                         show_default=True,
                         help="Attention kernel: flash-attn on CUDA when it is installed (auto), or PyTorch SDPA "
                              "(on a CPU, decoding steps through triforce's own kernel); sdpa-reference: PyTorch "
                              "SDPA for every step (the reference).")(f)
        return f
    return decorate


def context_options(f):
    """--max-context and --rope-scaling: how many tokens the context holds, past the model's
    trained context when its RoPE is stretched (see triforce.model.context_stretch)."""
    from triforce.model.context_stretch import KINDS

    f = click.option("--rope-scaling", type=click.Choice(KINDS), default=None,
                     help="Stretch the model's RoPE to --max-context tokens, past its trained context "
                          "(factor = max context / trained context), as llama.cpp's --rope-scaling.")(f)
    f = click.option("--max-context", type=INT, default=None,
                     help="Context size in tokens (default: the model's own). Beyond the trained context "
                          "it needs --rope-scaling.")(f)
    return f


def schedule_options(f):
    """--no-overlap, --no-hybrid, --draft-ahead: how a single prompt's offloaded KV moves."""
    f = click.option("--draft-ahead", is_flag=True,
                     help="Draft the next cycle while the full tier verifies this one; the drafts are kept when the "
                          "verify accepts every draft and its bonus token is the one guessed. Meant for a GPU whose "
                          "verify streams offloaded KV (not yet measured on one); on a CPU it runs in turn and costs "
                          "time.")(f)
    f = click.option("--no-hybrid", is_flag=True,
                     help="Stream all offloaded KV over PCIe (by default, on a GPU whose profile measured the CPU's "
                          "attention rates, CPU threads attend a share of it in place during decoding and verify "
                          "passes).")(f)
    return click.option("--no-overlap", is_flag=True,
                        help="Copy offloaded KV with the plain schedule (no prefetch).")(f)


special_tokens_option = click.option(
    "--parse-special-tokens", is_flag=True,
    help="Read control tokens written inside a chat message (e.g. <|im_end|>) as control tokens. By default a "
         "message's text is tokenized as text, so a user cannot forge the template's role markers.")


def run_options(default_method: str = "auto", count_syncs: bool = False, schedule: bool = False,
                special_tokens: bool = False):
    """The flags of every command that loads a model and decodes, which run_config makes one
    RunConfig: --model, --method and the speculation flags, --max-context, --rope-scaling, --dtype,
    --quantize, --device, --profile, --device-budget, --attn, --no-graphs, --threads; and where
    asked --count-syncs, schedule_options and --parse-special-tokens."""
    parts = [model_option, speculation_options(default_method), context_options, dtype_option, quantize_option,
             device_option, offload_options, runtime_options(count_syncs)]
    parts += ([schedule_options] if schedule else []) + ([special_tokens_option] if special_tokens else [])

    def decorate(f):
        for part in reversed(parts):
            f = part(f)
        return f
    return decorate


SPEC_FLAGS = ("method", "budget", "chunk_size", "gamma1", "gamma2", "rebuild_stride", "rebuild_threshold")
RUN_FLAGS = ("model", "draft", "dtype", "quantize", "device", "profile", "device_budget", "attn", "draft_ahead",
             "count_syncs", "max_context", "rope_scaling", "threads", "parse_special_tokens")


def run_config(flags: dict):
    """The RunConfig of a command's run flags, taken out of `flags` (as run_options added them;
    the sampling flags taken out before, by sampling_of)."""
    from triforce.config import RunConfig

    spec, fixed = build_spec(*(flags.pop(name) for name in SPEC_FLAGS))
    config = RunConfig(spec=spec, fixed=fixed, graphs="off" if flags.pop("no_graphs") else "auto",
                       overlap=not flags.pop("no_overlap", False), hybrid=not flags.pop("no_hybrid", False),
                       **{name: flags.pop(name) for name in RUN_FLAGS if name in flags})
    if flags:  # a flag added to run_options but not here would be dropped without a word
        raise TypeError(f"flags no RunConfig field takes: {sorted(flags)}")
    return config


def int_list(text: str, name: str) -> list[int]:
    """A flag's comma-separated positive integers (K and M as BoundedInt takes them), or one error line."""
    try:
        values = [count_of(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise UserError(f"{name} must be comma-separated integers, got '{text}'") from None
    if not values or min(values) < 1:
        raise UserError(f"{name} must list positive integers, got '{text}'")
    return values
