import gc
import os
import sys
from pathlib import Path

# Before torch loads its OpenMP runtime, as `import triforce` does for users: idle OpenMP threads
# sleep instead of spinning (a spinning one took half a core from every later test, and the
# other worker's core under `-n 2`).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from tiny_models import make_tiny_model  # noqa: E402

pytest_plugins = ["interrupt_plugin"]  # Ctrl-C ends the run even where the CLI turns it into exit 130

# `-n N` (pytest-xdist) runs N workers: each takes its share of the cores, as a user's two programs would.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // _WORKERS)))
# The suite's process holds torch, transformers and many models: at Python's default thresholds the
# cyclic collector walked that heap so often that tests/cuda_semantics took 152 s against 108 s with
# these (2-core EPYC, 2026-11-27). What a test checks is unchanged; bounded-memory tests collect themselves.
gc.set_threshold(50_000, 20, 20)
if not torch.cuda.is_available():
    # Triton kernels run on CPU tensors through Triton's interpreter (read when a kernel is defined)
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _float32_by_default(monkeypatch):
    """`--dtype auto` is bfloat16 on CPUs with native bfloat16 (this CI machine has it); the
    suite's exactness checks are float32's guarantee, so auto means float32 here unless a test
    says otherwise (tests/unit/test_cpu_features.py checks the real choice)."""
    from triforce.model import cpu_features
    monkeypatch.setattr(cpu_features, "native_bf16", lambda: False)


@pytest.fixture(autouse=True)
def _a_roomy_host(monkeypatch):
    """A card's plan takes this machine's host memory (triforce.plan.host_limits): here every
    test plans as on a 256 GiB machine, so no plan depends on the RAM of the machine running the
    suite (--host-memory still says another; tests of the reading itself patch it their way)."""
    from triforce.plan import host_limits

    real, roomy = host_limits.host_memory, host_limits.HostMemory(256 << 30, 256 << 30, "this machine (the suite's)")
    monkeypatch.setattr(host_limits, "host_memory", lambda override=None: real(override) if override else roomy)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """tiny_model_dir(family, **kw) -> folder of a random tiny checkpoint, cached per session."""
    made: dict = {}

    def get(family: str, **kw) -> Path:
        key = (family, tuple(sorted(kw.items())))
        if key not in made:
            folder = tmp_path_factory.mktemp(family)
            made[key] = make_tiny_model(folder, family, **kw)
        return made[key]

    return get


@pytest.fixture(scope="session")
def default_model_dir():
    """The real default model (SmolLM2-135M-Instruct), fetched and converted once."""
    from triforce.model.default_model import default_model_dir as resolve
    return resolve()


@pytest.fixture(scope="session")
def default_lm(default_model_dir):
    from triforce.model.loading import load_model
    return load_model(str(default_model_dir), dtype="float32", device="cpu")


@pytest.fixture
def overflowing_layer(monkeypatch):
    """Layer 1's output turns NaN once decoding starts (as an activation overflowing in float16
    would), in the failing pass and in the re-run that names it. `off()` ends it."""
    from triforce.model.decoder import DecoderLayer

    real, state = DecoderLayer.forward, {"decoding": False, "on": True}

    def forward(self, x, cos, sin, layer, cache_view, *args, **kwargs):
        out = real(self, x, cos, sin, layer, cache_view, *args, **kwargs)
        state["decoding"] |= x.shape[1] == 1
        return out * float("nan") if state["on"] and state["decoding"] and layer == 1 else out

    monkeypatch.setattr(DecoderLayer, "forward", forward)
    state["off"] = lambda: state.update(on=False, decoding=False)
    return state
