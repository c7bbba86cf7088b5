"""CPU kernels in numba (LLVM): decoding's few-query attention, the small-rows linear layers and
the layer halves around attention, the host's partial attention for the hybrid verify, and the
float32 (AVX2 FMA) and bfloat16 (AVX-512 BF16) dot products under them. Each is checked against the
device-neutral reference beside it in triforce.kernels (tests/unit)."""
