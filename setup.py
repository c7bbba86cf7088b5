"""One distribution, `triforce`, mapping the fixed top-level folders onto one import namespace."""
import re
from pathlib import Path

from setuptools import setup

# import name -> folder; every folder below one with an __init__.py is a package of it (the list
# is read from the tree: a hand-kept one once left kernels/cpu/'s subfolders out of `pip install .`)
ROOTS = {"triforce": "triforce_core", "triforce.offload": "offload", "triforce.pinned": "pinned",
         "triforce.kernels": "kernels", "triforce.bench": "bench", "triforce.profiles": "profiles"}


def packages() -> list[str]:
    return [".".join((name, *init.parent.relative_to(folder).parts))
            for name, folder in ROOTS.items() for init in sorted(Path(folder).rglob("__init__.py"))]


version = re.search(r'__version__ = "([^"]+)"', Path("triforce_core/__init__.py").read_text()).group(1)

setup(
    name="triforce",
    version=version,
    description="Lossless hierarchical speculative decoding for long-context LLMs on consumer GPUs",
    long_description=Path("README.md").read_text(),
    long_description_content_type="text/markdown",
    python_requires=">=3.11",  # tomllib reads memory profiles
    package_dir=ROOTS,
    packages=packages(),
    # the natural-text corpus, the chat page, the acceptance traces the GPU campaign replays
    package_data={"triforce.profiles": ["*.toml"], "triforce.kernels.cuda": ["*.json"], "triforce.app": ["*.txt.gz"],
                  "triforce.server": ["*.html"], "triforce.bench": ["traces/*.json"]},
    install_requires=[
        "torch>=2.5",
        "transformers>=4.56",
        "safetensors",
        "gguf>=0.17",  # quants.quantize and dequantize of Q4_0, Q4_1, Q8_0 (the block formats run as such)
        "accelerate",
        "numba",
        "psutil",
        "nvidia-ml-py",
        "click>=8",
        "tqdm",
        "filelock",  # one process builds each cache entry; the others wait
        "greenlet",  # a batch's rows as coroutines (triforce.decoding.lockstep)
        "starlette",  # `triforce serve`: the OpenAI-compatible HTTP API
        "uvicorn",
        "pydantic>=2",
    ],
    extras_require={
        "flash": ["flash-attn"],
        "bench": ["matplotlib"],
        # triton runs the retrieval kernels' tests on CPU through its interpreter
        "test": ["pytest", "pytest-xdist", "scipy", "pexpect", "matplotlib", "openai", "httpx", "websockets",
                 "triton; sys_platform == 'linux' and platform_machine == 'x86_64'"],
    },
    entry_points={"console_scripts": ["triforce=triforce.cli.main:main"]},
)
