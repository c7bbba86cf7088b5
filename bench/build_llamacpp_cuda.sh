#!/usr/bin/env bash
# llama.cpp's CUDA build (llama-bench) as a peer for the GPU campaign, built ahead on a machine
# without a GPU, for the cards we meet: sm_90 (H100/H200, the ones lent to us) and sm_89 (RTX 4090).
#
#   bash bench/build_llamacpp_cuda.sh [OUT] [ARCHS]     OUT default .device-kit/llamacpp-cuda
#                                                       ARCHS default "89-real;90-real"
#
# Sources: the llama.cpp vendored in PyPI's llama-cpp-python sdist (the CPU peer's, same version).
# CUDA: the nvcc on PATH (CUDA 13, as the card's driver 580 runs), else PyPI's nvidia-cuda-nvcc,
# nvidia-cuda-runtime and nvidia-cuda-cccl; cuBLAS from PyPI's nvidia-cublas (headers and the
# library to link; at run time the card's torch brings its own libcublas.so.13).
# Output: OUT/llama-bench.xz (ggml static inside, stripped; real SASS for ARCHS, no PTX; 63 MiB
# raw for both archs, 36 MiB compressed: a lease carries 64 MiB in all, so only the .xz stays) and
# OUT/VERSION. The campaign's peer step unpacks it on the card. Built on 2 cores in 93 minutes
# (2026-11-29): ARCHS=90-real alone is about half the CUDA work and size, for a lent H100/H200.
# On the card: LD_LIBRARY_PATH=$(python3 -c 'import nvidia, os; print(nvidia.__path__[0] + "/cu13/lib")') \
#   OUT/llama-bench -m FILE.gguf -ngl 99 -fa 1 -d DEPTH ...
# Its CPU part is portable x86-64 with AVX2 (llama.cpp's -nkvo runs attention there).
set -euo pipefail
OUT="${1:-.device-kit/llamacpp-cuda}"
ARCHS="${2:-89-real;90-real}"
VER=0.3.36
WORK="${LLAMACPP_WORK:-$HOME/.cache/llamacpp-cuda}"
JOBS="${JOBS:-$(nproc)}"
mkdir -p "$WORK" "$OUT"
OUT="$(cd "$OUT" && pwd)"
cd "$WORK"
[ -f "llama_cpp_python-$VER.tar.gz" ] || python3 -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$VER" -d .
[ -d "llama_cpp_python-$VER" ] || tar xzf "llama_cpp_python-$VER.tar.gz"
SRC="$WORK/llama_cpp_python-$VER/vendor/llama.cpp"

# the CUDA toolkit parts the build needs, from PyPI where the machine has none
TOOLS="$WORK/cuda"
if ! command -v nvcc >/dev/null; then
  python3 -m pip install -q --target "$TOOLS" nvidia-cuda-nvcc nvidia-cuda-runtime nvidia-cuda-cccl
  export PATH="$TOOLS/nvidia/cu13/bin:$PATH"
fi
CUBLAS="$TOOLS/nvidia/cu13"  # the wheel's layout: include/cublas_v2.h, lib/libcublas.so.13
[ -f "$CUBLAS/include/cublas_v2.h" ] || python3 -m pip install -q --target "$TOOLS" --no-deps nvidia-cublas
for lib in libcublas libcublasLt; do  # the linker wants the unversioned names the wheel leaves out
  [ -e "$CUBLAS/lib/$lib.so" ] || ln -s "$lib.so.13" "$CUBLAS/lib/$lib.so"
done
CUBLAS_INC="$CUBLAS/include"
CUBLAS_LIB="$CUBLAS/lib"
# the toolkit's own nvcc and root (the one on PATH may be a wrapper script)
ROOT="$(readlink -f "$(nvcc --dryrun -c -x cu /dev/null -o /dev/null 2>&1 | sed -n 's/^#\$ TOP=//p' | head -1)")"
NVCC="$ROOT/bin/nvcc"
echo "nvcc: $NVCC ($("$NVCC" --version | tail -1)); cuBLAS: $CUBLAS_LIB; archs: $ARCHS; $JOBS jobs"

cmake -S "$SRC" -B "$WORK/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES="$ARCHS" -DCMAKE_CUDA_COMPILER="$NVCC" \
  -DCUDAToolkit_ROOT="$ROOT" \
  -DCUDA_cublas_LIBRARY="$CUBLAS_LIB/libcublas.so" -DCUDA_cublasLt_LIBRARY="$CUBLAS_LIB/libcublasLt.so" \
  -DCMAKE_CUDA_FLAGS="-I$CUBLAS_INC" -DCMAKE_CXX_FLAGS="-I$CUBLAS_INC" -DCMAKE_C_FLAGS="-I$CUBLAS_INC" \
  -DGGML_CUDA_NO_VMM=ON -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
  -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
  -DLLAMA_BUILD_SERVER=OFF > "$WORK/cmake.log"
started=$(date +%s)
cmake --build "$WORK/build" -j "$JOBS" --target llama-bench > "$WORK/build.log"
cp "$WORK/build/bin/llama-bench" "$OUT/llama-bench"
strip "$OUT/llama-bench"
xz -T0 -6 -f "$OUT/llama-bench"  # -> llama-bench.xz
echo "llama.cpp $VER (llama-cpp-python's vendored tree), CUDA archs $ARCHS, built $(date -u +%F) in $(( $(date +%s) - started )) s" > "$OUT/VERSION"
cat "$OUT/VERSION"
ls -l "$OUT/llama-bench.xz"
