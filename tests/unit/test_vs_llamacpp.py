"""The llama.cpp comparison's --long row runs in the dtype this CPU picks, and says so before any
timing when that dtype's GGUF is missing."""
import torch
from click.testing import CliRunner

from triforce.bench import vs_llamacpp
from triforce.model.loading import resolve_dtype


def test_long_without_the_auto_dtypes_gguf_is_a_usage_error():
    auto = str(resolve_dtype("auto", torch.device("cpu"))).removeprefix("torch.")
    other = "bfloat16" if auto == "float32" else "float32"
    flags = ["--llama-bench", "x", "--gguf", f"{other}=y.gguf", "--long", "32000"]
    result = CliRunner().invoke(vs_llamacpp.main, flags)
    assert result.exit_code == 2 and f"--long runs in {auto} on this CPU" in result.output
