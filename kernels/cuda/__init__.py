"""CUDA kernels in Triton: the retrieval cache's chunk scoring and gather (their references are
triforce.kernels.retrieval's torch code, which takes over where Triton fails)."""
