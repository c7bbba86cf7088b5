"""CPU kernels in numba (LLVM), by job; each is checked against the device-neutral reference
beside it in triforce.kernels (tests/unit):

- `simd/`: what every kernel is built from: the one CPU feature detection (`features`), explicit
  8- and 16-lane float32 and bfloat16 dot products (AVX2 FMA, AVX-512 BF16), lane sums in a
  fixed order, exp, bfloat16 bits, software prefetch;
- `attention/`: decoding's few-query attention over a long KV view (`decode`), its scores and
  weighted values per format (`paths`, `f32_parts`, `bf16_*`), and the hybrid verify's partial
  attention over host KV blocks read in place (`host`);
- `linear/`: linear layers for a few rows: float weights (`dense`) and GGUF block weights
  (`blocks`, over `block_formats`, `block_dot` and Q4_K in `q4_k`);
- `layer`: a decoder layer's work around attention in two numba halves;
- `warm`: compiling all of it before the first token."""
